"""KV-cache sizing arithmetic (no configuration objects: benchmarks/gpu_check.py uses it on a
GPU image without pydantic)."""

from __future__ import annotations


def kv_cache_budget_bytes(
    total: int, free_before: int, allocated: int, peak: int, utilization: float, workspace: int,
    cuda_graph_bytes: int = 0,
) -> int:
    """Bytes left for the KV cache: the utilization share of the device, less what other
    processes hold, the profile step's peak (weights and activations), the attention
    workspace a decode step allocates on top of it (partition buffers), which the profile
    step (prefills only) never allocates, and the memory the decode CUDA graphs will hold
    (captured after the cache is allocated, so reserved here: worker/static_decode.py)."""
    used_by_others = total - free_before - allocated
    return int(total * utilization - used_by_others - peak - workspace - cuda_graph_bytes)
