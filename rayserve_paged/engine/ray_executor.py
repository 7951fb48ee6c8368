"""The Ray executor: one Worker actor per tensor-parallel rank in a placement group.

    placement group (STRICT_PACK)
      bundle 0          the Serve replica and the SchedulerActor
      bundle 1 .. TP    Worker actor rank 0 .. TP-1 (a GPU each on GPU clusters)

Each step's SchedulerOutput is put in the object store once and every rank reads the same
object; rank 0 returns the sampled tokens. The ranks meet in torch.distributed (NCCL on GPU,
gloo on CPU) at a free port of rank 0's node.
"""

from __future__ import annotations

import logging
import socket

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.outputs import SchedulerOutput
from rayserve_paged.engine.executor import Executor
from rayserve_paged.models.sampler import SamplerOutput
from rayserve_paged.worker.worker import CacheSizes, Worker

logger = logging.getLogger(__name__)


class WorkerActor(Worker):
    """A Worker that can also join the tensor-parallel process group and name its node."""

    def node_address(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ip, port

    def init_distributed(self, init_method: str) -> None:
        if self.world_size == 1:
            self.load_model()
            return
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world_size)
        self.load_model(group=dist.group.WORLD)


def is_gpu(config: EngineConfig) -> bool:
    if config.device == "auto":
        return bool(ray.cluster_resources().get("GPU", 0))
    return config.device == "cuda"


def worker_bundle(config: EngineConfig, worker_cpus: float) -> dict:
    bundle = {"CPU": worker_cpus}
    if is_gpu(config):
        bundle["GPU"] = 1
    return bundle


class RayExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        pg: PlacementGroup | None = None,
        first_worker_bundle: int = 1,
        worker_cpus: float = 1.0,
    ) -> None:
        self.config = config
        tp = config.tensor_parallel_size
        self._own_pg = None
        pg = pg or get_current_placement_group()
        if pg is None:
            # outside Serve (tests, scripts): a group of our own, workers only
            pg = placement_group([worker_bundle(config, worker_cpus)] * tp, strategy="STRICT_PACK")
            ray.get(pg.ready())
            self._own_pg = pg
            first_worker_bundle = 0
        num_gpus = 1 if is_gpu(config) else 0
        actor_class = ray.remote(WorkerActor)
        self.workers = [
            actor_class.options(
                num_cpus=worker_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=first_worker_bundle + rank
                ),
            ).remote(config, model_path, rank, tp)
            for rank in range(tp)
        ]

    def initialize(self) -> CacheSizes:
        ip, port = ray.get(self.workers[0].node_address.remote())
        ray.get([w.init_distributed.remote(f"tcp://{ip}:{port}") for w in self.workers])
        sizes = ray.get([w.determine_num_blocks.remote() for w in self.workers])
        # every rank holds the same block ids: the smallest pool decides
        num_gpu = min(s.num_gpu_blocks for s in sizes)
        num_cpu = min(s.num_cpu_blocks for s in sizes)
        ray.get([w.init_cache.remote(num_gpu, num_cpu) for w in self.workers])
        return CacheSizes(num_gpu, num_cpu, sizes[0].block_bytes)

    def execute(self, out: SchedulerOutput) -> SamplerOutput:
        if len(self.workers) == 1:
            return ray.get(self.workers[0].execute.remote(out))
        ref = ray.put(out)  # serialised once, read by every rank
        results = ray.get([w.execute.remote(ref) for w in self.workers])
        return results[0]

    def gpu_snapshots(self) -> list[dict]:
        return ray.get([w.gpu_snapshot.remote() for w in self.workers], timeout=10)

    def check_health(self, timeout_s: float = 10.0) -> None:
        ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._own_pg is not None:
            ray.util.remove_placement_group(self._own_pg)
            self._own_pg = None
