"""KV-cache sizing arithmetic (no configuration objects: benchmarks/gpu_check.py uses it on a
GPU image without pydantic)."""

from __future__ import annotations


def kv_cache_budget_bytes(
    total: int, free_before: int, allocated: int, peak: int, utilization: float, workspace: int
) -> int:
    """Bytes left for the KV cache: the utilization share of the device, less what other
    processes hold, the profile step's peak (weights and activations) and the attention
    workspace a decode step allocates on top of it (partition buffers), which the profile
    step (prefills only) never allocates."""
    used_by_others = total - free_before - allocated
    return int(total * utilization - used_by_others - peak - workspace)
