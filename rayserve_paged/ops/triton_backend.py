"""The triton attention backend and the checked wrappers that launch `triton_kernels.py`.

    TritonBackend().forward(query, key, value, key_cache, value_cache, metadata, scale)
        = reshape_and_cache            the step's new K/V into their slots (PAD_SLOT skipped)
        + paged_prefill_attention      on tokens [0, num_prefill_tokens)
        + paged_decode_attention       on tokens [num_prefill_tokens, + num_decode_tokens)
        rows past the real tokens are zeros

Every wrapper checks shapes, dtypes, strides and devices and raises ValueError naming the
problem before anything is launched; none of the checks reads a device tensor (no sync).
Kernels run on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before
triton was imported (the tests do this). swap_blocks is not a kernel: GPU <-> pinned CPU
copies are cache_ops.swap_blocks / swap_kv_blocks, re-exported here.

Decode variant (see choose_decode_variant and docs/KERNELS.md): "single" runs one program
per (sequence, kv head) over the whole context; "partitioned" also splits the context into
PARTITION_SIZE-token partitions and reduces them in a second kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import triton_kernels as kernels
from .attention import AttentionMetadata
from .cache_ops import (
    BlockMapping,
    KVCache,
    _check_block_ids,
    _check_cache_pair,
    _check_mapping_tensor,
    _check_reshape_and_cache,
    _mapping_to_pairs,
    _require_same_layout,
    swap_blocks,
    swap_kv_blocks,
)
from .paged_attention import AttentionBackend, check_attention_inputs

__all__ = [
    "PARTITION_SIZE",
    "TritonBackend",
    "choose_decode_variant",
    "copy_blocks",
    "is_interpreted",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "swap_blocks",
    "swap_kv_blocks",
]

SUPPORTED_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # tested: 16 (tiny models), 48, 64, 80, 96, 128, 256
_INDEX_DTYPES = (torch.int32, torch.int64)

DecodeVariant = Literal["auto", "single", "partitioned"]
PARTITION_SIZE = 512  # tokens of context per program in the partitioned decode
MIN_PROGRAMS_PER_SM = 4  # below this many (sequence, kv head) programs per SM, partition
NOMINAL_NUM_SMS = 132  # SM count assumed off-GPU (the interpreter): an H100 / H200


def is_interpreted() -> bool:
    """Whether the kernels were built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(kernels.paged_decode_kernel, InterpretedFunction)


# ---------------------------------------------------------------------------- backend


class TritonBackend(AttentionBackend):
    """Paged attention in Triton kernels: CUDA, or CPU under TRITON_INTERPRET=1."""

    name = "triton"

    def forward(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale, out=None):
        """`out` (optional, [num_tokens, num_heads, head_dim]) receives the result in place."""
        check_attention_inputs(query, key, value, key_cache, value_cache, metadata)
        _check_can_launch(query.device)
        reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, H, D]
        else:
            _check_out(out, query)
        num_prefill_tokens = metadata.num_prefill_tokens
        num_real_tokens = num_prefill_tokens + metadata.num_decode_tokens
        out[num_real_tokens:].zero_()  # padding tokens
        if metadata.num_prefills:
            paged_prefill_attention(
                query[:num_prefill_tokens], key_cache, value_cache, metadata.prefill_block_tables,
                metadata.prefill_query_start_loc, metadata.prefill_context_lens,
                metadata.max_prefill_query_len, scale, out=out[:num_prefill_tokens],
            )
        if metadata.num_decodes:
            paged_decode_attention(
                query[num_prefill_tokens:num_real_tokens], key_cache, value_cache,
                metadata.decode_block_tables, metadata.decode_seq_lens, metadata.max_decode_seq_len,
                scale, out=out[num_prefill_tokens:num_real_tokens],
            )
        return out

    @staticmethod
    def copy_blocks(kv_caches: Sequence[KVCache], block_mapping: BlockMapping) -> None:
        copy_blocks(kv_caches, block_mapping)

    @staticmethod
    def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: BlockMapping) -> None:
        swap_blocks(src_cache, dst_cache, block_mapping)


# ---------------------------------------------------------------------------- decode


def choose_decode_variant(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, partition_size: int = PARTITION_SIZE
) -> Literal["single", "partitioned"]:
    """The rule: partition when the context spans more than one partition AND the single
    variant's grid is too small to keep the GPU busy:

        partitioned  iff  max_seq_len > partition_size
                          and  num_seqs * num_kv_heads < MIN_PROGRAMS_PER_SM * num_sms

    The single variant runs num_seqs * num_kv_heads programs, each walking its whole context
    serially; with fewer than a few programs per SM most of the memory bandwidth sits idle.
    Partitioning multiplies the programs by ceil(max_seq_len / partition_size) at the cost of
    a second (small) launch and fp32 partials of num_seqs * num_heads * partitions * head_dim.
    """
    if max_seq_len > partition_size and num_seqs * num_kv_heads < MIN_PROGRAMS_PER_SM * num_sms:
        return "partitioned"
    return "single"


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one new token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs]: cached tokens including the new one (>= 1)
    max_seq_len: int,  # host copy of max(seq_lens): sizes the partitioned grid
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    variant: DecodeVariant = "auto",
    partition_size: int = PARTITION_SIZE,
) -> torch.Tensor:
    """Each sequence's query attends to its first seq_lens[i] cached tokens; returns `out`."""
    _check_attention_common(query, key_cache, value_cache, block_tables, "decode")
    num_seqs, num_heads, head_dim = query.shape
    _check_index(seq_lens, "seq_lens", (num_seqs,), query.device)
    _require(
        variant in ("auto", "single", "partitioned"), f"variant must be auto, single or partitioned, got {variant!r}"
    )
    _require(partition_size > 0, f"partition_size must be positive, got {partition_size}")
    _require(
        max_seq_len <= block_tables.shape[1] * key_cache.shape[1],
        f"max_seq_len={max_seq_len} does not fit block_tables of {block_tables.shape[1]} blocks x "
        f"{key_cache.shape[1]} tokens",
    )
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [num_seqs, num_heads, head_dim]
    else:
        _check_out(out, query)
    if num_seqs == 0:
        return out
    _require(max_seq_len >= 1, f"max_seq_len must be >= 1 for {num_seqs} sequences, got {max_seq_len}")
    num_kv_heads = key_cache.shape[2]
    if variant == "auto":
        variant = choose_decode_variant(num_seqs, num_kv_heads, max_seq_len, _num_sms(query.device), partition_size)
    common = _attention_constants(query, key_cache)
    group_size = num_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group_size))
    tile_n = 64 if common["HEAD_PAD"] <= 128 else 32
    strides = dict(
        stride_q_token=query.stride(0), stride_q_head=query.stride(1),
        stride_cache_block=key_cache.stride(0), stride_cache_slot=key_cache.stride(1),
        stride_cache_head=key_cache.stride(2), stride_table_seq=block_tables.stride(0),
    )
    constants = dict(common, GROUP_SIZE=group_size, GROUP_PAD=group_pad, TILE_N=tile_n, num_warps=4)
    scale_log2 = float(scale) * kernels.LOG2E
    if variant == "single":
        kernels.paged_decode_kernel[(num_seqs, num_kv_heads)](
            out, query, key_cache, value_cache, block_tables, seq_lens, scale_log2,
            stride_out_token=out.stride(0), stride_out_head=out.stride(1), **strides, **constants,
        )
        return out
    max_partitions = triton.cdiv(max_seq_len, partition_size)
    head_pad = common["HEAD_PAD"]
    stats_shape = (num_seqs, num_heads, max_partitions)
    partial_out = torch.empty((*stats_shape, head_pad), dtype=torch.float32, device=query.device)  # [S, H, P, D_pad]
    max_logits = torch.empty(stats_shape, dtype=torch.float32, device=query.device)  # [S, H, P]
    exp_sums = torch.empty(stats_shape, dtype=torch.float32, device=query.device)  # [S, H, P]
    kernels.paged_decode_partition_kernel[(num_seqs, num_kv_heads, max_partitions)](
        partial_out, max_logits, exp_sums, query, key_cache, value_cache, block_tables, seq_lens, scale_log2,
        num_heads=num_heads, max_partitions=max_partitions, PARTITION_SIZE=partition_size, **strides, **constants,
    )
    kernels.paged_decode_reduce_kernel[(num_seqs, num_heads)](
        out, partial_out, max_logits, exp_sums, seq_lens,
        stride_out_token=out.stride(0), stride_out_head=out.stride(1),
        num_heads=num_heads, max_partitions=max_partitions,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, PARTITION_SIZE=partition_size,
        PARTITIONS_PAD=max(2, triton.next_power_of_2(max_partitions)), num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------- prefill


def paged_prefill_attention(
    query: torch.Tensor,  # [num_prefill_tokens, num_heads, head_dim], packed by sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]: new tokens already written
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_prefills, max_blocks] int32/int64
    query_start_loc: torch.Tensor,  # [num_prefills + 1]: cumulative new-token counts
    context_lens: torch.Tensor,  # [num_prefills]: tokens cached before the step
    max_query_len: int,  # host copy of max new tokens per sequence: sizes the grid
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [num_prefill_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """New token i of sequence s (position context_lens[s] + i) attends to positions
    0..context_lens[s] + i of that sequence, all read through the block table; returns `out`."""
    _check_attention_common(query, key_cache, value_cache, block_tables, "prefill")
    num_prefills = block_tables.shape[0]
    _check_index(query_start_loc, "query_start_loc", (num_prefills + 1,), query.device)
    _check_index(context_lens, "context_lens", (num_prefills,), query.device)
    _require(
        0 <= max_query_len <= query.shape[0],
        f"max_query_len={max_query_len} must be in [0, num_prefill_tokens={query.shape[0]}]",
    )
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, H, D]
    else:
        _check_out(out, query)
    if num_prefills == 0 or max_query_len == 0:
        return out
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    common = _attention_constants(query, key_cache)
    group_size = num_heads // num_kv_heads
    block_m = max(64 if common["HEAD_PAD"] <= 128 else 32, triton.next_power_of_2(group_size))
    block_q = block_m // group_size
    grid = (triton.cdiv(max_query_len, block_q), num_prefills, num_kv_heads)
    kernels.paged_prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
        float(scale) * kernels.LOG2E,
        stride_q_token=query.stride(0), stride_q_head=query.stride(1),
        stride_out_token=out.stride(0), stride_out_head=out.stride(1),
        stride_cache_block=key_cache.stride(0), stride_cache_slot=key_cache.stride(1),
        stride_cache_head=key_cache.stride(2), stride_table_seq=block_tables.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE_N=64 if common["HEAD_PAD"] <= 128 else 32, num_warps=4, **common,
    )
    return out


# ---------------------------------------------------------------------------- cache ops


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; PAD_SLOT (-1) writes nothing
) -> None:
    """Write token i's key/value into slot `slot_mapping[i]`; the same contract as cache_ops."""
    _check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    _check_can_launch(key.device)
    _require(
        key.stride(2) == 1 and value.stride(2) == 1,
        f"key and value need a contiguous last dim, got strides {key.stride()} and {value.stride()}",
    )
    _require(key_cache.dtype in SUPPORTED_DTYPES, f"cache dtype {key_cache.dtype} is not one of {_dtype_names()}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kernels.reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1],
        num_warps=4,
    )


def copy_blocks(kv_caches: Sequence[KVCache], block_mapping: BlockMapping) -> None:
    """Copy whole blocks src -> dst in every layer's key and value cache, in one launch.

    Unlike cache_ops.copy_blocks, a block may not be both a source and a destination in one
    mapping (copy-on-write never produces that: a dst is a freshly allocated block); host
    mappings are checked for it, device tensors are trusted (checking them would sync).
    """
    if not kv_caches:
        raise ValueError("copy_blocks: kv_caches is empty (expected one (key, value) per layer)")
    for layer, (key_cache, value_cache) in enumerate(kv_caches):
        _check_cache_pair(key_cache, value_cache, where=f"layer {layer}")
        _require_same_layout(kv_caches[0][0], key_cache, f"layer {layer}", "layer 0")
    first = kv_caches[0][0]
    _check_can_launch(first.device)
    _require(first.dtype in SUPPORTED_DTYPES, f"cache dtype {first.dtype} is not one of {_dtype_names()}")
    mapping = _mapping_on_device(block_mapping, first.shape[0], first.device)  # [num_pairs, 2] int64
    if mapping.shape[0] == 0:
        return
    caches = [key for key, _ in kv_caches] + [value for _, value in kv_caches]
    pointers = _pointer_table(tuple(cache.data_ptr() for cache in caches), first.device)  # [2 * num_layers]
    block_numel = first[0].numel()
    kernels.copy_blocks_kernel[(len(caches), mapping.shape[0])](
        pointers, mapping, block_numel,
        COPY_TILE=min(4096, triton.next_power_of_2(block_numel)), DTYPE=SUPPORTED_DTYPES[first.dtype],
        num_warps=4,
    )


def _mapping_on_device(block_mapping: BlockMapping, num_blocks: int, device: torch.device) -> torch.Tensor:
    if isinstance(block_mapping, torch.Tensor) and block_mapping.device.type != "cpu":
        _check_mapping_tensor(block_mapping)
        _require(block_mapping.device == device, f"block_mapping is on {block_mapping.device}, caches on {device}")
        return block_mapping.contiguous()
    pairs = _mapping_to_pairs(block_mapping)
    _check_block_ids(pairs, num_blocks, num_blocks)
    both = {src for src, _ in pairs} & {dst for _, dst in pairs}
    _require(not both, f"block_mapping uses blocks {sorted(both)} as both source and destination")
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).to(device)  # [num_pairs, 2]


@functools.lru_cache(maxsize=8)
def _pointer_table(pointers: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Base addresses of the cache tensors as an int64 tensor on their device. Keyed by the
    addresses themselves, so a reallocated cache gets a fresh table."""
    return torch.tensor(pointers, dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------- checks


def _check_can_launch(device: torch.device) -> None:
    if device.type == "cuda" or (device.type == "cpu" and is_interpreted()):
        return
    raise ValueError(
        f"the triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
        f"triton is imported), got tensors on {device}"
    )


def _check_attention_common(query, key_cache, value_cache, block_tables, part: str) -> None:
    _require(query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    _check_cache_pair(key_cache, value_cache)
    _check_can_launch(query.device)
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    _require(query.dtype in SUPPORTED_DTYPES, f"query dtype {query.dtype} is not one of {_dtype_names()}")
    _require(key_cache.dtype == query.dtype, f"key_cache dtype {key_cache.dtype} != query dtype {query.dtype}")
    _require(query.device == key_cache.device, f"query is on {query.device} but key_cache is on {key_cache.device}")
    _require(query.stride(2) == 1, f"query needs a contiguous last dim, got strides {query.stride()}")
    _require(cache_head_dim == head_dim, f"query head_dim={head_dim} != cache head_dim={cache_head_dim}")
    _require(
        MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM,
        f"head_dim={head_dim} is outside the supported [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]",
    )
    _require(block_size in SUPPORTED_BLOCK_SIZES, f"block_size={block_size} is not one of {SUPPORTED_BLOCK_SIZES}")
    _require(
        num_heads % num_kv_heads == 0,
        f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}",
    )
    _require(
        block_tables.dim() == 2, f"{part} block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}"
    )
    _require(
        block_tables.dtype in _INDEX_DTYPES, f"{part} block_tables must be int32 or int64, got {block_tables.dtype}"
    )
    _require(
        block_tables.device == query.device,
        f"{part} block_tables is on {block_tables.device} but query is on {query.device}",
    )
    _require(
        block_tables.shape[0] == 0 or block_tables.shape[1] == 0 or block_tables.stride(1) == 1,
        f"{part} block_tables rows must be contiguous, got strides {block_tables.stride()}",
    )
    if part == "decode":
        _require(
            block_tables.shape[0] == query.shape[0],
            f"decode block_tables has {block_tables.shape[0]} rows for {query.shape[0]} query tokens",
        )


def _check_index(tensor: torch.Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    _require(tuple(tensor.shape) == shape, f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    _require(tensor.dtype in _INDEX_DTYPES, f"{name} must be int32 or int64, got {tensor.dtype}")
    _require(tensor.device == device, f"{name} is on {tensor.device} but query is on {device}")
    _require(tensor.is_contiguous(), f"{name} must be contiguous")


def _check_out(out: torch.Tensor, query: torch.Tensor) -> None:
    _require(out.shape == query.shape, f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    _require(out.dtype == query.dtype, f"out dtype {out.dtype} != query dtype {query.dtype}")
    _require(out.device == query.device, f"out is on {out.device} but query is on {query.device}")
    _require(out.dim() != 3 or out.stride(2) == 1, f"out needs a contiguous last dim, got strides {out.stride()}")


def _attention_constants(query: torch.Tensor, key_cache: torch.Tensor) -> dict:
    """Compile-time constants shared by the attention kernels."""
    head_dim = query.shape[2]
    dot_dtype, precision = _dot_operands(query.dtype)
    return dict(
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1],
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
    )


def _dot_operands(dtype: torch.dtype):
    """(tl.dot operand dtype, input precision). float32 uses IEEE, not TF32, so the result
    matches the torch reference; bfloat16 under the interpreter is computed in float32
    because the interpreter's tl.dot multiplies bfloat16 bit patterns as integers."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreted()):
        return tl.float32, "ieee"
    return SUPPORTED_DTYPES[dtype], "tf32"  # the precision only applies to float32 operands


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return NOMINAL_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dtype_names() -> str:
    return ", ".join(str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
