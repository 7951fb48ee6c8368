"""Executors run the workers. The engine only sees this interface, so the in-process path
(offline `LLM`, tests) and the Ray path (Serve) share every line above and below it."""

from __future__ import annotations

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.outputs import StepMessage
from rayserve_paged.models.sampler import SamplerOutput
from rayserve_paged.worker.worker import CacheSizes, Worker


class Executor:
    """initialize() loads the model and sizes the KV cache; execute() runs one step."""

    def initialize(self) -> CacheSizes:
        raise NotImplementedError

    def execute(self, msg: StepMessage) -> SamplerOutput:
        raise NotImplementedError

    def add_lora(self, key: tuple, adapter) -> None:
        """Give every rank a newly registered LoRA adapter's tensors (models/lora.PeftAdapter,
        read and checked once by the engine), before any step names `key`. Called off the
        step thread; the workers drop them when a step's `lora_forgets` names the key."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def gpu_snapshots(self) -> list[dict]:
        """Each rank's GPU figures (telemetry)."""
        return []

    def batch_states(self) -> list[tuple[int, int]]:
        """Each rank's (requests, sequences) held in its persistent batch."""
        return []

    def shutdown(self) -> None:
        """Release workers."""


class InProcessExecutor(Executor):
    """One worker (tensor_parallel_size 1) in the engine's own process."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size} needs the Ray executor; "
                "the in-process executor runs one rank"
            )
        self.worker = Worker(config, model_path)

    def initialize(self) -> CacheSizes:
        self.worker.load_model()
        sizes = self.worker.determine_num_blocks()
        self.worker.init_cache(sizes.num_gpu_blocks, sizes.num_cpu_blocks)
        return sizes

    def execute(self, msg: StepMessage) -> SamplerOutput:
        return self.worker.execute(msg)

    def add_lora(self, key: tuple, adapter) -> None:
        self.worker.add_lora(key, adapter)

    def gpu_snapshots(self) -> list[dict]:
        return [self.worker.gpu_snapshot()]

    def batch_states(self) -> list[tuple[int, int]]:
        return [self.worker.batch_state()]
