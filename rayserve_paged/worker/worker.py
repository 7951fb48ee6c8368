"""One tensor-parallel rank: its model shard, its share of every KV block (device pool and
CPU swap pool), and the step: swap out, swap in, copy, then run the model.

Workers never allocate blocks: the scheduler's block ids and (src, dst) lists are applied
as given. All ranks use the same block ids and hold only their own KV heads.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass

import torch

from rayserve_paged.config import DEFAULT_CPU_KV_CACHE_GB, EngineConfig
from rayserve_paged.core.outputs import NewRequest, StepMessage
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.models.layers import ParallelState
from rayserve_paged.models.loader import get_model_config, load_model
from rayserve_paged.models.lora import LoRAError, LoRAPool
from rayserve_paged.models.sampler import Sampler, SamplerOutput
from rayserve_paged.models.tiny import resolve_model
from rayserve_paged.ops.cache_ops import BlockSwapper
from rayserve_paged.ops.backends import get_attention_backend
from rayserve_paged.telemetry import GpuProbe
from rayserve_paged.worker.draft_model import DraftModel, check_draft_model
from rayserve_paged.worker.kv_sizing import kv_cache_budget_bytes
from rayserve_paged.worker.model_runner import ModelRunner
from rayserve_paged.worker.static_decode import StaticDecode, capture_graphs, verification_rows

logger = logging.getLogger(__name__)

GiB = 1 << 30


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on its own anonymous mapping: the kernel hands out zero pages on first
    touch, so a KV pool costs resident memory only for the blocks ever written (4 KiB pages;
    huge pages are declined, their 2 MiB would span ~170 blocks of a small model's layer)."""
    numel = torch.Size(shape).numel()
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, numel * dtype.itemsize)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # the tensor holds the mapping


@dataclass(slots=True)
class CacheSizes:
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_bytes: int  # one block, all layers, K and V, this rank


def resolve_device(device: str, rank: int = 0) -> torch.device:
    """The rank's device, with its index: every torch.cuda call takes `cuda:N` (an unindexed
    torch.device("cuda") makes torch.cuda.set_device raise). N is the rank's visible
    device: 0 where the rank sees one GPU (a Ray actor sees only the GPU of its bundle),
    else rank modulo the visible devices."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        return torch.device(device)
    if not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device("cuda", rank % torch.cuda.device_count())


def choose_dtype(config: EngineConfig, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    # CPU kernels are float32; GPUs run the checkpoint's dtype (float32 checkpoints in bf16)
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if checkpoint_dtype == torch.float32 else checkpoint_dtype


def cpu_thread_count(configured: int | None) -> tuple[int, str]:
    """(torch intra-op threads for a CPU worker, where the number came from).

    The worker's CPU allocation, most specific first: `num_cpu_threads` from the config;
    else OMP_NUM_THREADS, which Ray sets in an actor to its `num_cpus` (floored, at least 1);
    else the CPUs this process may run on (its affinity mask, which cgroup cpusets and
    `taskset` narrow), not every core of the machine.
    """
    if configured:
        return configured, "num_cpu_threads"
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) >= 1:
        return int(env), "OMP_NUM_THREADS"
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1), "CPU affinity"
    return max(os.cpu_count() or 1, 1), "os.cpu_count()"


class Worker:
    def __init__(self, config: EngineConfig, model_path: str, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.model_path = model_path
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(config.device, rank)
        self.model_config = get_model_config(model_path)
        self.dtype = choose_dtype(config, self.model_config.torch_dtype, self.device)
        self.num_kv_heads = self.model_config.num_kv_heads_per_rank(world_size)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cpu_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.swapper = BlockSwapper([], [])
        self.runner: ModelRunner | None = None
        self.num_steps = 0
        self.execute_s = 0.0  # wall time inside execute(): swaps, copies, model, sampler
        self.gpu_probe = GpuProbe(rank, self.device)
        self.backend = None  # the attention backend, once the model is loaded
        self.warmed_up: list[str] = []  # kernel variants compiled at start-up
        self.cuda_graphs: list[int] = []  # decode buckets captured at start-up
        spec = config.speculative_config
        self.draft_model_config = None  # the draft model's (speculative_config method draft_model)
        if spec is not None and spec.method == "draft_model":
            self.draft_path = str(resolve_model(spec.model))
            self.draft_model_config = get_model_config(self.draft_path)
            check_draft_model(self.model_config, self.draft_model_config, self.max_model_len)
        self.draft: DraftModel | None = None  # loaded with the model

    # ------------------------------------------------------------------ start-up

    def load_model(self, group=None) -> None:
        if self.device.type == "cpu":
            num_threads, source = cpu_thread_count(self.config.num_cpu_threads)
            torch.set_num_threads(num_threads)
            logger.info("rank %d: %d torch threads (%s)", self.rank, num_threads, source)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if group is not None and self.world_size > 1:
            self._warm_up_collective(group)
        backend = self.backend = get_attention_backend(self.config.attention_backend, self.device)
        parallel = ParallelState(self.rank, self.world_size, group)
        model = load_model(
            self.model_path, self.dtype, self.device, backend, parallel=parallel, quantization=self.config.quantization
        )
        eos = tuple(self.model_config.eos_token_ids)
        sampler = Sampler(len(eos), eos) if self.rank == 0 else None
        static = None if self.config.enforce_eager else StaticDecode(
            model, self.config.block_size, self.config.max_num_seqs, self.max_model_len, self.device, backend,
            # NCCL runs inside the capture at TP > 1: its calls on other threads must not
            # invalidate the capture (the global mode forbids them process-wide)
            capture_error_mode="thread_local" if self.world_size > 1 else "global",
            max_num_rows=self._verification_rows(),
        )
        self.runner = ModelRunner(model, self.config.block_size, self.device, sampler, backend, static)
        if self.config.is_lora_enabled:
            cfg = self.config
            self.runner.lora = LoRAPool(model, cfg.max_loras, cfg.max_lora_rank)
        if self.draft_model_config is not None:
            self.draft = self._load_draft(backend, sampler)
            self.runner.drafter = self.draft
        logger.info(
            "rank %d loaded %s (%s, %s, attention %s)", self.rank, self.model_path, self.dtype, self.device, backend.name
        )

    def _load_draft(self, backend, sampler: Sampler) -> DraftModel:
        """The draft model, whole on this rank (tensor_parallel_size 1), in the target's dtype."""
        model = load_model(self.draft_path, self.dtype, self.device, backend, quantization="auto")
        logger.info("rank %d loaded the draft model %s", self.rank, self.draft_path)
        return DraftModel(model, self.draft_model_config, self.config.block_size, self.device, backend, sampler)

    def _verification_rows(self) -> int | None:
        """Rows a CPU decode step can hold with its draft verifications expanded (None: no
        speculation, or a device whose verifications run eagerly)."""
        spec, cfg = self.config.speculative_config, self.config
        if spec is None or self.device.type != "cpu":
            return None
        return verification_rows(cfg.max_num_seqs, cfg.resolved_max_num_batched_tokens(self.max_model_len),
                                 spec.num_speculative_tokens, spec.disable_by_batch_size)  # fmt: skip

    def _warm_up_collective(self, group) -> None:
        """One all-reduce on the rank's device before anything is measured: NCCL allocates
        its communication buffers at the first collective, and the KV sizing must see them."""
        import torch.distributed as dist

        probe = torch.ones(1, device=self.device)
        dist.all_reduce(probe, group=group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if int(probe.item()) != self.world_size:
            raise RuntimeError(f"rank {self.rank}: the warm-up all-reduce gave {probe.item()}, not {self.world_size}")

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len or self.model_config.max_model_len

    def block_bytes(self) -> int:
        """One block id's bytes, K and V of every layer: the target's, and the draft model's
        (its pool has a block for each of the target's)."""
        mc = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_layer = self.num_kv_heads * mc.head_dim
        total = mc.num_layers * per_layer
        if self.draft_model_config is not None:
            dc = self.draft_model_config
            total += dc.num_layers * dc.num_kv_heads * dc.head_dim
        return 2 * self.config.block_size * total * elem

    def determine_num_blocks(self) -> CacheSizes:
        """KV blocks this rank can hold: explicit on CPU, profiled on GPU."""
        block_bytes = self.block_bytes()
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            num_gpu = cfg.num_gpu_blocks_override
        elif self.device.type == "cpu" or cfg.kv_cache_memory_gb is not None:
            gb = cfg.kv_cache_memory_gb if cfg.kv_cache_memory_gb is not None else DEFAULT_CPU_KV_CACHE_GB
            num_gpu = int(gb * GiB) // block_bytes
        else:
            num_gpu = self._profile_gpu_blocks(block_bytes)
        num_cpu = int((cfg.swap_space_gb + cfg.kv_offload_memory_gb) * GiB) // block_bytes  # one CPU pool
        return CacheSizes(num_gpu, num_cpu, block_bytes)

    def _profile_gpu_blocks(self, block_bytes: int) -> int:
        """Run a dummy step at the token budget, then give what is left to the KV cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        try:
            self._profile_run()
        except torch.OutOfMemoryError as error:
            self._release_caches()
            raise RuntimeError(self._profile_oom_message()) from error
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self._release_caches()
        allocated = torch.cuda.memory_allocated(self.device)  # weights: the profile caches are gone
        graph_bytes = self._profile_cuda_graphs()
        budget = kv_cache_budget_bytes(
            total, free_before, allocated, peak, self.config.gpu_memory_utilization, self.decode_workspace_bytes(),
            cuda_graph_bytes=graph_bytes,
        )
        return max(budget // block_bytes, 0)

    def _profile_oom_message(self) -> str:
        max_len = self.max_model_len
        tokens = self.config.resolved_max_num_batched_tokens(max_len)
        where = (
            f"max_model_len {max_len}" if self.config.max_model_len
            else f"max_model_len is not set, so the model's own {max_len} (max_position_embeddings) is used"
        )
        return (
            f"rank {self.rank}: the start-up profile step ({tokens} tokens in one batch) ran out of memory on "
            f"{self.device}: {where}. Set max_model_len lower, or enable_chunked_prefill / max_num_batched_tokens "
            "to bound the profile step"
        )

    def _release_caches(self) -> None:
        """Drop every reference to the current caches (the swapper holds them too) and hand
        their memory back to the device, so that the profile caches are gone before the real
        pool is allocated."""
        self.kv_caches = []
        self.cpu_caches = []
        self.swapper = BlockSwapper([], [])
        if self.draft is not None:
            self.draft.set_caches([], [])
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _profile_cuda_graphs(self) -> int:
        """What the decode CUDA graphs captured after the KV cache is allocated will hold
        (reserved from the KV budget; 0 when none will be captured), estimated on a one-block
        cache by StaticDecode.profile_bytes."""
        static = self.runner.static_decode
        if static is None or not static.can_capture:
            return 0
        self._allocate_caches(1, 0)
        try:
            return static.profile_bytes(self.kv_caches)
        finally:
            self._release_caches()

    def decode_workspace_bytes(self) -> int:
        """The attention backend's largest per-layer decode buffers at max_num_seqs x max_model_len."""
        mc = self.model_config
        max_len = self.max_model_len
        return self.backend.decode_workspace_bytes(
            self.config.max_num_seqs, mc.num_heads // self.world_size, self.num_kv_heads, mc.head_dim, max_len,
            self.device,
        )

    def _profile_run(self) -> None:
        max_len = self.max_model_len
        budget = self.config.resolved_max_num_batched_tokens(max_len)
        seq_len = min(max_len, budget)
        num_seqs = max(1, budget // seq_len)
        bs = self.config.block_size
        num_blocks = -(-seq_len // bs)
        self._allocate_caches(num_blocks, 0)
        params = SamplingParams(temperature=1.0, max_tokens=1)
        ids = [f"profile-{i}" for i in range(num_seqs)]
        msg = StepMessage(
            new_requests=[NewRequest(ids[i], i, params, seq_len) for i in range(num_seqs)],
            block_table_updates=[(i, 0, list(range(num_blocks))) for i in range(num_seqs)],
            seq_ids=list(range(num_seqs)),
            start_positions=[0] * num_seqs,
            num_query_tokens=[seq_len] * num_seqs,
            token_ids=[0] * (seq_len * num_seqs),
        )
        self.runner.execute(msg, self.kv_caches)
        self.runner.execute(StepMessage(finished_request_ids=ids), self.kv_caches)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._release_caches()  # nothing of the profile steps outlives them
        self._allocate_caches(num_gpu_blocks, num_cpu_blocks)
        self.warm_up()
        # after the warm-up (no kernel compiles inside a capture); the KV sizing reserved their memory
        self.cuda_graphs = capture_graphs(self.runner.static_decode, self.kv_caches, self.rank)

    def warm_up(self) -> list[str]:
        """Compile every attention kernel variant now, before the engine reports ready, so
        that no step stalls on a compile while serving (a no-op for the torch backend)."""
        if not self.kv_caches or self.kv_caches[0][0].shape[0] == 0:
            return []
        mc = self.model_config
        num_heads = mc.num_heads // self.world_size
        qkv_stride = (num_heads + 2 * self.num_kv_heads) * mc.head_dim  # queries are slices of one QKV projection
        start = time.perf_counter()
        self.warmed_up = self.backend.warm_up(*self.kv_caches[0], num_heads, qkv_stride)
        if self.draft is not None:
            self.warmed_up += self.draft.warm_up()
        if self.warmed_up:
            logger.info("rank %d compiled %d attention kernel variants in %.1f s: %s", self.rank,
                        len(self.warmed_up), time.perf_counter() - start, ", ".join(self.warmed_up))
        return self.warmed_up

    def _allocate_caches(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        mc = self.model_config
        self.kv_caches, self.cpu_caches = self._pools(
            num_gpu_blocks, num_cpu_blocks, mc.num_layers, self.num_kv_heads, mc.head_dim
        )
        self.swapper = BlockSwapper(self.kv_caches, self.cpu_caches)
        if self.draft is not None:  # the same block ids, the draft's layer and head shapes
            dc = self.draft_model_config
            pools = self._pools(num_gpu_blocks, num_cpu_blocks, dc.num_layers, dc.num_kv_heads, dc.head_dim)
            self.draft.set_caches(*pools)

    def _pools(self, num_gpu_blocks: int, num_cpu_blocks: int, num_layers: int, num_kv_heads: int, head_dim: int):
        """(device pool, CPU swap pool): per layer, (key, value) caches of
        [num_blocks, block_size, num_kv_heads, head_dim]."""
        shape = (num_gpu_blocks, self.config.block_size, num_kv_heads, head_dim)
        cpu_shape = (num_cpu_blocks, *shape[1:])
        pin = self.device.type == "cuda"

        def zeros(shape, device):
            if device.type == "cpu" and not pin:
                return host_zeros(shape, self.dtype)
            return torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin and device.type == "cpu")

        device_pool = [(zeros(shape, self.device), zeros(shape, self.device)) for _ in range(num_layers)]
        cpu = torch.device("cpu")
        return device_pool, [(zeros(cpu_shape, cpu), zeros(cpu_shape, cpu)) for _ in range(num_layers)]

    # ------------------------------------------------------------------ the step

    def execute(self, msg: StepMessage, token_bitmasks: bytes | None = None) -> SamplerOutput | None:
        """One step. At TP > 1 the token bitmasks come apart, to rank 0 only (the rank
        that samples): `token_bitmasks`, put back into the message here."""
        if token_bitmasks is not None:
            msg.token_bitmasks = token_bitmasks
        start = time.perf_counter()
        try:
            return self._execute(msg)
        finally:
            self.num_steps += 1
            self.execute_s += time.perf_counter() - start

    def _execute(self, msg: StepMessage) -> SamplerOutput | None:
        # The swapper orders its side-stream copies against this stream with events: no sync here.
        self.swapper.move(msg.blocks_to_swap_out, msg.blocks_to_swap_in, msg.blocks_to_copy)
        if self.draft is not None:
            self.draft.move_blocks(msg)
        failures = self._apply_lora_updates(msg) if msg.lora_slot_updates or msg.lora_forgets else None
        out = self.runner.execute(msg, self.kv_caches)
        if failures and out is not None:
            out.lora_failures = failures
        return out

    def _apply_lora_updates(self, msg: StepMessage) -> list[tuple[tuple, str]]:
        """Drop retired adapters, then fill the changed slots from CPU memory; an adapter
        that cannot be activated is reported (its slot left empty), the step goes on."""
        pool = self.runner.lora
        for key in msg.lora_forgets:
            pool.remove(key)
        failures = []
        for slot, key in msg.lora_slot_updates:
            try:
                pool.activate(slot, key)
            except (LoRAError, RuntimeError) as exc:  # RuntimeError: a device copy that failed
                logger.error("rank %d: LoRA adapter %d not activated: %s", self.rank, key[0], exc)
                failures.append((key, str(exc)))
        return failures

    def add_lora(self, key: tuple, adapter) -> None:
        """Keep a newly registered adapter's tensors (cut to this rank) in CPU memory; called
        off the step thread, before any step names the key."""
        self.runner.lora.add(key, adapter)

    def ping(self) -> int:
        return os.getpid()

    def gpu_snapshot(self) -> dict:
        """GPU memory, allocator and KV pool figures of this rank, as plain data."""
        draft = self.draft
        kv_caches = self.kv_caches if draft is None else self.kv_caches + draft.kv_caches
        cpu_caches = self.cpu_caches if draft is None else self.cpu_caches + draft.cpu_caches
        return self.gpu_probe.snapshot(kv_caches, cpu_caches).to_dict()

    def batch_state(self) -> tuple[int, int]:
        """(requests, sequences) this rank holds state for; (0, 0) once all have ended."""
        batch = self.runner.batch
        return batch.num_requests, batch.num_seqs

    def timing(self) -> tuple[int, float]:
        """(steps executed, seconds inside execute) since start-up."""
        return self.num_steps, self.execute_s
