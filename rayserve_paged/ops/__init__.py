"""Kernels over the paged KV cache: cache writes, block moves, attention backends."""

from .attention import PAD_SLOT, AttentionMetadata
from .cache_ops import copy_blocks, reshape_and_cache, swap_blocks, swap_kv_blocks
from .backends import BACKEND_NAMES, get_attention_backend
from .paged_attention import AttentionBackend, TorchReferenceBackend, check_attention_inputs

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
