"""Kernels over the paged KV cache: cache writes, block moves, attention backends."""

from .attention import PAD_SLOT, AttentionMetadata
from .cache_ops import copy_blocks, reshape_and_cache, swap_blocks, swap_kv_blocks
from .paged_attention import (
    BACKEND_NAMES,
    AttentionBackend,
    TorchReferenceBackend,
    check_attention_inputs,
    get_attention_backend,
)

__all__ = [
    "BACKEND_NAMES",
    "PAD_SLOT",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchReferenceBackend",
    "check_attention_inputs",
    "copy_blocks",
    "get_attention_backend",
    "reshape_and_cache",
    "swap_blocks",
    "swap_kv_blocks",
]
