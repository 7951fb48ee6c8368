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

Decode variant (see choose_decode_partition and docs/KERNELS.md): "single" runs one program
per (sequence, kv head) over the whole context; "partitioned" also splits the context into
partitions of one of PARTITION_SIZES tokens and reduces them in a second kernel.

Every compile-time constant comes from the *_constants functions below, which depend on the
model's shape only: triton_aot.py compiles exactly those ahead of time for sm_80/89/90 and
warm_up() launches each variant once at start-up, so no kernel compiles while serving.
copy_blocks is cache_ops.copy_blocks (one gather and one scatter per cache tensor).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
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
    _check_cache_pair,
    _check_reshape_and_cache,
    copy_blocks,
    swap_blocks,
    swap_kv_blocks,
)
from .paged_attention import AttentionBackend, StepPlan, check_layer_inputs

__all__ = [
    "PARTITION_SIZES",
    "TritonBackend",
    "choose_decode_partition",
    "choose_decode_variant",
    "copy_blocks",
    "decode_workspace_bytes",
    "is_interpreted",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "swap_blocks",
    "swap_kv_blocks",
    "warm_up",
]

SUPPORTED_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # tested: 16 (tiny models), 48, 64, 80, 96, 128, 256
_INDEX_DTYPES = (torch.int32, torch.int64)

DecodeVariant = Literal["auto", "single", "partitioned"]
PARTITION_SIZES = (256, 512, 1024)  # tokens of context per program in the partitioned decode
PARTITION_CHUNK = 32  # partitions the reduce kernel combines per loop iteration
MAX_SINGLE_PASS_LEN = 8192  # longer contexts are always partitioned
MIN_PROGRAMS_PER_SM = 4  # below this many (sequence, kv head) programs per SM, partition
NOMINAL_NUM_SMS = 132  # SM count assumed off-GPU (the interpreter): an H100 / H200


def is_interpreted() -> bool:
    """Whether the kernels were built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(kernels.paged_decode_kernel, InterpretedFunction)


# ---------------------------------------------------------------------------- backend


class TritonStepPlan(StepPlan):
    """StepPlan plus the launches every layer of the step makes (planned at its first layer)."""

    def __init__(self, metadata: AttentionMetadata) -> None:
        super().__init__(metadata)
        self.cache_write: _CacheWriteLaunch | Callable = _no_launch
        self.prefill: _PrefillLaunch | None = None
        self.decode: _DecodeLaunch | None = None


class TritonBackend(AttentionBackend):
    """Paged attention in Triton kernels: CUDA, or CPU under TRITON_INTERPRET=1."""

    name = "triton"
    supports_cuda_graphs = True  # launches depend on shapes and max_decode_seq_len only

    def forward(
        self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale,
        sliding_window=None, soft_cap=None, out=None,
    ):  # fmt: skip
        """`out` (optional, [num_tokens, num_heads, head_dim]) receives the result in place."""
        plan = self._layer_plan(query, key, value, key_cache, value_cache, metadata)
        plan.cache_write(key, value, key_cache, value_cache, metadata.slot_mapping)
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, H, D]
        else:
            _check_out(out, query)
        num_prefill_tokens, num_real_tokens = plan.num_prefill_tokens, plan.num_real_tokens
        if num_real_tokens < plan.num_tokens:
            out[num_real_tokens:].zero_()  # padding tokens
        if plan.prefill is not None:
            plan.prefill(
                query[:num_prefill_tokens], key_cache, value_cache, metadata.prefill_block_tables,
                metadata.prefill_query_start_loc, metadata.prefill_context_lens, scale,
                out=out[:num_prefill_tokens], sliding_window=sliding_window, soft_cap=soft_cap,
            )
        if plan.decode is not None:
            plan.decode(
                plan.decode_rows(query), key_cache, value_cache, metadata.decode_block_tables,
                metadata.decode_seq_lens, scale, out=plan.decode_rows(out),
                sliding_window=sliding_window, soft_cap=soft_cap,
            )
        return out

    def _check_layer(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata) -> None:
        """The torch backend's checks plus every launch wrapper's, on the step's parts."""
        check_layer_inputs(query, key, value, key_cache, value_cache, metadata)
        _check_cache_write_inputs(key, value, key_cache, value_cache, metadata.slot_mapping)
        num_prefill_tokens = metadata.num_prefill_tokens
        num_real_tokens = num_prefill_tokens + metadata.num_decode_tokens
        if metadata.num_prefills:
            _check_prefill_inputs(
                query[:num_prefill_tokens], key_cache, value_cache, metadata.prefill_block_tables,
                metadata.prefill_query_start_loc, metadata.prefill_context_lens, metadata.max_prefill_query_len,
            )
        if metadata.num_decodes:
            _check_decode_inputs(
                query[num_prefill_tokens:num_real_tokens], key_cache, value_cache, metadata.decode_block_tables,
                metadata.decode_seq_lens, metadata.max_decode_seq_len,
            )

    def _new_plan(self, metadata: AttentionMetadata) -> TritonStepPlan:
        return TritonStepPlan(metadata)

    def _plan_layer(self, plan: TritonStepPlan, query, key, value, key_cache) -> None:
        metadata, num_prefill_tokens = plan.metadata, plan.num_prefill_tokens
        plan.cache_write = _CacheWriteLaunch(key, value, key_cache) if key.shape[0] else _no_launch
        plan.prefill = None
        if metadata.num_prefills and metadata.max_prefill_query_len:
            plan.prefill = _PrefillLaunch(
                query[:num_prefill_tokens], key_cache, metadata.prefill_block_tables, metadata.max_prefill_query_len
            )
        plan.decode = None
        if metadata.num_decodes:
            plan.decode = _DecodeLaunch(
                plan.decode_rows(query), key_cache, metadata.decode_block_tables,
                metadata.max_decode_seq_len,
            )

    @staticmethod
    def copy_blocks(kv_caches: Sequence[KVCache], block_mapping: BlockMapping) -> None:
        copy_blocks(kv_caches, block_mapping)

    def warm_up(self, key_cache, value_cache, num_heads: int, query_token_stride: int | None = None) -> list[str]:
        """Compile every kernel variant for this cache now (see warm_up below)."""
        if is_interpreted():
            return []  # the interpreter compiles nothing
        maskings = self.layer_maskings or {(False, False)}
        return warm_up(key_cache, value_cache, num_heads, query_token_stride=query_token_stride, maskings=maskings)

    def decode_workspace_bytes(
        self, max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int, device
    ) -> int:
        return decode_workspace_bytes(
            max_num_seqs, num_heads, num_kv_heads, head_dim, max_seq_len, _num_sms(torch.device(device))
        )

    @staticmethod
    def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: BlockMapping) -> None:
        swap_blocks(src_cache, dst_cache, block_mapping)


# ---------------------------------------------------------------------------- launch constants
#
# What each wrapper passes as compile-time constants, as functions of the model's shape only
# (never of a step's batch): the ahead-of-time compile check (triton_aot.py) compiles exactly
# these, and warm_up() launches each once, so serving never compiles a kernel.


def attention_tiles(kind: Literal["decode", "prefill"], dtype: torch.dtype, head_dim: int, group_size: int) -> dict:
    """Tile shape and warps of an attention kernel, chosen so that no fp16/bf16 variant spills
    registers on sm_80 / sm_89 / sm_90 and float32 stays within a few bytes (docs/KERNELS.md
    has the compiled register and shared-memory figures)."""
    head_pad = triton.next_power_of_2(head_dim)
    wide = dtype == torch.float32  # 4-byte operands: half the tile for the same registers
    rows_min = max(16, triton.next_power_of_2(group_size))
    if kind == "decode":
        tile_n = 64 if head_pad <= 128 else 32
        num_warps = 8 if wide and head_pad == 128 else 4  # fp32 at 128 spilled on sm_90 with 4
        return dict(GROUP_PAD=rows_min, TILE_N=tile_n // 2 if wide else tile_n, num_warps=num_warps)
    if wide:
        block_m, tile_n, num_warps = (32, 32, 8) if head_pad <= 128 else (16, 32, 8)
    elif head_pad <= 64:
        block_m, tile_n, num_warps = 64, 64, 4
    elif head_pad <= 128:
        block_m, tile_n, num_warps = 64, 64, 8
    else:
        block_m, tile_n, num_warps = 32, 32, 4
    block_m = max(block_m, rows_min)
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group_size, TILE_N=tile_n, num_warps=num_warps)


def attention_constants(
    kind: Literal["decode", "prefill"], dtype: torch.dtype, head_dim: int, num_kv_heads: int, group_size: int,
    block_size: int, *, interpreted: bool,
) -> dict:
    """Constants (and num_warps) of paged_decode_kernel / paged_decode_partition_kernel
    (kind "decode") or paged_prefill_kernel ("prefill")."""
    return dict(
        _attention_constants(dtype, head_dim, num_kv_heads, block_size, interpreted),
        GROUP_SIZE=group_size, **attention_tiles(kind, dtype, head_dim, group_size),
    )


def reduce_constants(head_dim: int, partition_size: int) -> dict:
    """Constants (and num_warps) of paged_decode_reduce_kernel."""
    return dict(
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), PARTITION_SIZE=partition_size,
        PARTITION_CHUNK=PARTITION_CHUNK, num_warps=4,
    )


def cache_write_constants(head_dim: int, num_kv_heads: int, block_size: int) -> dict:
    """Constants (and num_warps) of reshape_and_cache_kernel."""
    return dict(
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, num_warps=4,
    )


def _attention_constants(dtype, head_dim: int, num_kv_heads: int, block_size: int, interpreted: bool) -> dict:
    dot_dtype, precision = _dot_operands(dtype, interpreted)
    return dict(
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
    )


def _dot_operands(dtype: torch.dtype, interpreted: bool):
    """(tl.dot operand dtype, input precision). float32 uses IEEE, not TF32, so the result
    matches the torch reference; bfloat16 under the interpreter is computed in float32
    because the interpreter's tl.dot multiplies bfloat16 bit patterns as integers."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted):
        return tl.float32, "ieee"
    return SUPPORTED_DTYPES[dtype], "tf32"  # the precision only applies to float32 operands


# ---------------------------------------------------------------------------- decode


def choose_decode_partition(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """The partition size for a decode batch, or 0 for the single-pass kernel:

        single        iff  max_seq_len <= PARTITION_SIZES[0]                (nothing to split)
                      or  (num_seqs * num_kv_heads >= MIN_PROGRAMS_PER_SM * num_sms
                            and max_seq_len <= MAX_SINGLE_PASS_LEN)
        partitioned   otherwise, with the largest size in PARTITION_SIZES whose grid
                      num_seqs * num_kv_heads * ceil(max_seq_len / size) still gives
                      MIN_PROGRAMS_PER_SM programs per SM (the smallest size when none does)

    The single variant runs num_seqs * num_kv_heads programs, each walking its whole context
    serially: with too few programs the memory bandwidth sits idle, and past
    MAX_SINGLE_PASS_LEN one long sequence in a batch of short ones walks its context alone
    while the rest of the GPU waits (vLLM's single-pass kernel stops at 8192 tokens too).
    Partitioning costs a second, small launch and float32 partials of num_seqs * num_heads *
    partitions * (head_pad + 2) values (decode_workspace_bytes)."""
    smallest = PARTITION_SIZES[0]
    if max_seq_len <= smallest:
        return 0
    target = MIN_PROGRAMS_PER_SM * num_sms
    programs = num_seqs * num_kv_heads
    if programs >= target and max_seq_len <= MAX_SINGLE_PASS_LEN:
        return 0
    for size in reversed(PARTITION_SIZES):
        if programs * triton.cdiv(max_seq_len, size) >= target:
            return size
    return smallest


def choose_decode_variant(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int
) -> Literal["single", "partitioned"]:
    """choose_decode_partition as a name: "single" or "partitioned"."""
    return "partitioned" if choose_decode_partition(num_seqs, num_kv_heads, max_seq_len, num_sms) else "single"


def decode_workspace_bytes(
    max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int, num_sms: int
) -> int:
    """The most bytes of partition buffers one decode launch can allocate for batches of up to
    max_num_seqs sequences and contexts up to max_seq_len (the KV-cache sizing reserves it)."""
    # The rule depends on the length only through ceil(length / size) for sizes that are all
    # multiples of the smallest, which is constant between multiples of the smallest: the
    # largest buffer is reached at one of them (or at max_seq_len itself).
    step = PARTITION_SIZES[0]
    lengths = [*range(step, max_seq_len, step), max_seq_len]
    most = 0
    for num_seqs in range(1, max_num_seqs + 1):
        for length in lengths:
            size = choose_decode_partition(num_seqs, num_kv_heads, length, num_sms)
            if size:
                most = max(most, _partition_buffer_bytes(num_seqs, num_heads, triton.cdiv(length, size), head_dim))
    return most


def _partition_buffer_bytes(num_seqs: int, num_heads: int, num_partitions: int, head_dim: int) -> int:
    """float32 partial outputs [S, H, P, head_pad] + row maxima and sums [S, H, P]."""
    return 4 * num_seqs * num_heads * num_partitions * (triton.next_power_of_2(head_dim) + 2)


def _partition_buffers(num_seqs: int, num_heads: int, num_partitions: int, head_dim: int, device):
    stats_shape = (num_seqs, num_heads, num_partitions)
    head_pad = triton.next_power_of_2(head_dim)
    partial_out = torch.empty((*stats_shape, head_pad), dtype=torch.float32, device=device)  # [S, H, P, D_pad]
    max_logits = torch.empty(stats_shape, dtype=torch.float32, device=device)  # [S, H, P]
    exp_sums = torch.empty(stats_shape, dtype=torch.float32, device=device)  # [S, H, P]
    return partial_out, max_logits, exp_sums


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
    partition_size: int | None = None,  # None: choose_decode_partition's (or the smallest when forced)
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Each sequence's query attends to its first seq_lens[i] cached tokens (the last
    sliding_window of them, when set; scores soft-capped when soft_cap is); returns `out`."""
    _check_decode_inputs(query, key_cache, value_cache, block_tables, seq_lens, max_seq_len)
    _check_window_and_cap(sliding_window, soft_cap)
    if variant not in ("auto", "single", "partitioned"):
        raise ValueError(f"variant must be auto, single or partitioned, got {variant!r}")
    if not (partition_size is None or partition_size > 0):
        raise ValueError(f"partition_size must be positive, got {partition_size}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [num_seqs, num_heads, head_dim]
    else:
        _check_out(out, query)
    if query.shape[0]:
        launch = _DecodeLaunch(query, key_cache, block_tables, max_seq_len, variant, partition_size)
        launch(
            query, key_cache, value_cache, block_tables, seq_lens, scale, out=out,
            sliding_window=sliding_window, soft_cap=soft_cap,
        )
    return out


class _DecodeLaunch:
    """The grid, constants and strides of one decode batch's launches, planned once (per step
    in the backend: every layer with the same shapes launches with them). The partitioned
    variant's float32 buffers are allocated at the first launch and reused by the next ones:
    the launches run in order on one stream, each reduce before the next partition kernel."""

    def __init__(self, query, key_cache, block_tables, max_seq_len: int, variant="auto", partition_size=None):
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
        if variant == "single":
            partition_size = 0
        elif partition_size is None:
            partition_size = choose_decode_partition(num_seqs, num_kv_heads, max_seq_len, _num_sms(query.device))
            if variant == "partitioned" and not partition_size:
                partition_size = PARTITION_SIZES[0]
        self.partition_size = partition_size  # 0: the single-pass kernel
        self.num_seqs, self.num_heads, self.num_kv_heads, self.head_dim = num_seqs, num_heads, num_kv_heads, head_dim
        self.device = query.device
        self.constants = attention_constants(
            "decode", query.dtype, head_dim, num_kv_heads, num_heads // num_kv_heads, block_size,
            interpreted=is_interpreted(),
        )
        self.strides = dict(
            stride_q_token=query.stride(0), stride_q_head=query.stride(1), stride_table_seq=block_tables.stride(0),
        )
        self.max_partitions = triton.cdiv(max_seq_len, partition_size) if partition_size else 0
        self._buffers = None

    def __call__(
        self, query, key_cache, value_cache, block_tables, seq_lens, scale: float, *, out,
        sliding_window: int | None = None, soft_cap: float | None = None,
    ) -> None:  # fmt: skip
        scale_log2 = float(scale) * kernels.LOG2E
        window, cap_log2, masking = masking_arguments(sliding_window, soft_cap)
        num_seqs, num_heads = self.num_seqs, self.num_heads
        if not self.partition_size:
            kernels.paged_decode_kernel[(num_seqs, self.num_kv_heads)](
                out, query, key_cache, value_cache, block_tables, seq_lens, scale_log2, window, cap_log2,
                stride_out_token=out.stride(0), stride_out_head=out.stride(1), **self.strides, **self.constants,
                **masking,
            )
            return
        if self._buffers is None:
            self._buffers = _partition_buffers(num_seqs, num_heads, self.max_partitions, self.head_dim, self.device)
        partial_out, max_logits, exp_sums = self._buffers
        max_partitions = self.max_partitions
        kernels.paged_decode_partition_kernel[(num_seqs, self.num_kv_heads, max_partitions)](
            partial_out, max_logits, exp_sums, query, key_cache, value_cache, block_tables, seq_lens, scale_log2,
            window, cap_log2, num_heads=num_heads, max_partitions=max_partitions,
            PARTITION_SIZE=self.partition_size, **self.strides, **self.constants, **masking,
        )
        kernels.paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out, partial_out, max_logits, exp_sums, seq_lens, window,
            stride_out_token=out.stride(0), stride_out_head=out.stride(1),
            num_heads=num_heads, max_partitions=max_partitions,
            **reduce_constants(self.head_dim, self.partition_size), SLIDING=masking["SLIDING"],
        )


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
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """New token i of sequence s (position p = context_lens[s] + i) attends to positions
    0..p of that sequence (p - sliding_window < k <= p with a window), all read through the
    block table; returns `out`."""
    _check_prefill_inputs(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, max_query_len)
    _check_window_and_cap(sliding_window, soft_cap)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, H, D]
    else:
        _check_out(out, query)
    if block_tables.shape[0] and max_query_len:
        launch = _PrefillLaunch(query, key_cache, block_tables, max_query_len)
        launch(
            query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, out=out,
            sliding_window=sliding_window, soft_cap=soft_cap,
        )
    return out


class _PrefillLaunch:
    """The grid, constants and strides of one prefill launch, planned once (per step in the backend)."""

    def __init__(self, query, key_cache, block_tables, max_query_len: int):
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
        self.constants = attention_constants(
            "prefill", query.dtype, head_dim, num_kv_heads, num_heads // num_kv_heads, block_size,
            interpreted=is_interpreted(),
        )
        self.grid = (triton.cdiv(max_query_len, self.constants["BLOCK_Q"]), block_tables.shape[0], num_kv_heads)
        self.strides = dict(
            stride_q_token=query.stride(0), stride_q_head=query.stride(1), stride_table_seq=block_tables.stride(0)
        )

    def __call__(
        self, query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, *, out,
        sliding_window: int | None = None, soft_cap: float | None = None,
    ):  # fmt: skip
        window, cap_log2, masking = masking_arguments(sliding_window, soft_cap)
        kernels.paged_prefill_kernel[self.grid](
            out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
            float(scale) * kernels.LOG2E, window, cap_log2, stride_out_token=out.stride(0),
            stride_out_head=out.stride(1), **self.strides, **self.constants, **masking,
        )


def masking_arguments(sliding_window: int | None, soft_cap: float | None) -> tuple[int, float, dict]:
    """(window, cap_log2, {SLIDING, SOFT_CAP}) of the attention kernels: one compiled variant
    per combination, whatever the window's or cap's value."""
    masking = dict(SLIDING=sliding_window is not None, SOFT_CAP=soft_cap is not None)
    return sliding_window or 0, float(soft_cap or 1.0) * kernels.LOG2E, masking


def _check_window_and_cap(sliding_window, soft_cap) -> None:
    if not (sliding_window is None or (isinstance(sliding_window, int) and sliding_window > 0)):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if not (soft_cap is None or soft_cap > 0):
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap!r}")


# ---------------------------------------------------------------------------- cache ops


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; PAD_SLOT (-1) writes nothing
) -> None:
    """Write token i's key/value into slot `slot_mapping[i]`; the same contract as cache_ops."""
    _check_cache_write_inputs(key, value, key_cache, value_cache, slot_mapping)
    if key.shape[0]:
        _CacheWriteLaunch(key, value, key_cache)(key, value, key_cache, value_cache, slot_mapping)


class _CacheWriteLaunch:
    """reshape_and_cache_kernel's grid, strides and constants, planned once (per step in the backend)."""

    def __init__(self, key, value, key_cache):
        num_tokens, num_kv_heads, head_dim = key.shape
        self.grid = (num_tokens,)
        self.strides = (key.stride(0), key.stride(1), value.stride(0), value.stride(1))
        self.constants = cache_write_constants(head_dim, num_kv_heads, key_cache.shape[1])

    def __call__(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        kernels.reshape_and_cache_kernel[self.grid](
            key, value, key_cache, value_cache, slot_mapping, *self.strides, **self.constants
        )


# ---------------------------------------------------------------------------- warm-up


def warm_up(
    key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int, *, query_token_stride: int | None = None,
    maskings=((False, False),),
) -> list[str]:
    """Launch every kernel variant a step can use with this cache once, so that none compiles
    after start-up: reshape_and_cache, prefill, single-pass decode, and the partitioned decode
    and its reduce for every size in PARTITION_SIZES, each attention kernel once per
    (sliding window, soft-cap) pair in `maskings` (the model's layers'). Nothing in the cache is written (every
    slot is PAD_SLOT) and only block 0 is read. `query_token_stride` is the token stride of
    the model's queries (a slice of one QKV projection: (num_heads + 2 * num_kv_heads) *
    head_dim), so the launches specialise on the same values as the model's. Returns the
    names of what was launched."""
    _check_cache_pair(key_cache, value_cache)
    _check_can_launch(key_cache.device)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    device, dtype = key_cache.device, key_cache.dtype
    width = num_heads * head_dim
    stride = query_token_stride or (num_heads + 2 * num_kv_heads) * head_dim
    if not (stride >= width):
        raise ValueError(f"query_token_stride={stride} is below num_heads * head_dim = {width}")
    num_tokens = 2
    qkv = torch.zeros((num_tokens, stride + 2 * num_kv_heads * head_dim), dtype=dtype, device=device)
    query = qkv[:, :width].view(num_tokens, num_heads, head_dim)  # strided like the model's slices
    key = qkv[:, stride : stride + num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, stride + num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    pad = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    reshape_and_cache(key, value, key_cache, value_cache, pad)
    launched = ["reshape_and_cache"]
    index = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=dtype, device=device)
    tables, lens = index([[0]]), index([1])
    for sliding, capped in sorted(maskings):
        masking = dict(sliding_window=1 if sliding else None, soft_cap=1.0 if capped else None)
        suffix = "".join((" windowed" if sliding else "", " soft-capped" if capped else ""))
        paged_prefill_attention(
            query, key_cache, value_cache, index([[0]]), index([0, num_tokens]), index([0]), num_tokens, 1.0,
            out=out, **masking,
        )
        launched.append("prefill" + suffix)
        paged_decode_attention(
            query[:1], key_cache, value_cache, tables, lens, 1, 1.0, out=out[:1], variant="single", **masking
        )
        launched.append("decode single" + suffix)
        for size in PARTITION_SIZES:
            paged_decode_attention(
                query[:1], key_cache, value_cache, tables, lens, 1, 1.0, out=out[:1], variant="partitioned",
                partition_size=size, **masking,
            )
            launched.append(f"decode partitioned {size}" + suffix)
    return launched


# ---------------------------------------------------------------------------- checks


def _check_decode_inputs(query, key_cache, value_cache, block_tables, seq_lens, max_seq_len: int) -> None:
    _check_attention_common(query, key_cache, value_cache, block_tables, "decode")
    num_seqs = query.shape[0]
    _check_index(seq_lens, "seq_lens", (num_seqs,), query.device)
    if max_seq_len > block_tables.shape[1] * key_cache.shape[1]:
        raise ValueError(
            f"max_seq_len={max_seq_len} does not fit block_tables of {block_tables.shape[1]} blocks x "
            f"{key_cache.shape[1]} tokens"
        )
    if num_seqs and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1 for {num_seqs} sequences, got {max_seq_len}")


def _check_prefill_inputs(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, max_query_len):
    _check_attention_common(query, key_cache, value_cache, block_tables, "prefill")
    num_prefills = block_tables.shape[0]
    _check_index(query_start_loc, "query_start_loc", (num_prefills + 1,), query.device)
    _check_index(context_lens, "context_lens", (num_prefills,), query.device)
    if not (0 <= max_query_len <= query.shape[0]):
        raise ValueError(f"max_query_len={max_query_len} must be in [0, num_prefill_tokens={query.shape[0]}]")


def _check_cache_write_inputs(key, value, key_cache, value_cache, slot_mapping) -> None:
    _check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    _check_can_launch(key.device)
    if not (key.stride(2) == 1 and value.stride(2) == 1):
        raise ValueError(f"key and value need a contiguous last dim, got strides {key.stride()} and {value.stride()}")
    if key_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"cache dtype {key_cache.dtype} is not one of {_dtype_names()}")


def _no_launch(*args) -> None:
    """The launch of a step part with nothing to compute."""


def _check_can_launch(device: torch.device) -> None:
    if device.type == "cuda" or (device.type == "cpu" and is_interpreted()):
        return
    raise ValueError(
        f"the triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
        f"triton is imported), got tensors on {device}"
    )


def _check_attention_common(query, key_cache, value_cache, block_tables, part: str) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    _check_cache_pair(key_cache, value_cache)
    _check_can_launch(query.device)
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} is not one of {_dtype_names()}")
    if key_cache.dtype != query.dtype:
        raise ValueError(f"key_cache dtype {key_cache.dtype} != query dtype {query.dtype}")
    if query.device != key_cache.device:
        raise ValueError(f"query is on {query.device} but key_cache is on {key_cache.device}")
    if query.stride(2) != 1:
        raise ValueError(f"query needs a contiguous last dim, got strides {query.stride()}")
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim={head_dim} != cache head_dim={cache_head_dim}")
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM):
        raise ValueError(f"head_dim={head_dim} is outside the supported [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size={block_size} is not one of {SUPPORTED_BLOCK_SIZES}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if block_tables.dim() != 2:
        raise ValueError(f"{part} block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    if block_tables.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{part} block_tables must be int32 or int64, got {block_tables.dtype}")
    if block_tables.device != query.device:
        raise ValueError(f"{part} block_tables is on {block_tables.device} but query is on {query.device}")
    if not (block_tables.shape[0] == 0 or block_tables.shape[1] == 0 or block_tables.stride(1) == 1):
        raise ValueError(f"{part} block_tables rows must be contiguous, got strides {block_tables.stride()}")
    if part == "decode":
        if block_tables.shape[0] != query.shape[0]:
            raise ValueError(f"decode block_tables has {block_tables.shape[0]} rows for {query.shape[0]} query tokens")


def _check_index(tensor: torch.Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    if tensor.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but query is on {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_out(out: torch.Tensor, query: torch.Tensor) -> None:
    if out.shape != query.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    if out.dtype != query.dtype:
        raise ValueError(f"out dtype {out.dtype} != query dtype {query.dtype}")
    if out.device != query.device:
        raise ValueError(f"out is on {out.device} but query is on {query.device}")
    if not (out.dim() != 3 or out.stride(2) == 1):
        raise ValueError(f"out needs a contiguous last dim, got strides {out.stride()}")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return NOMINAL_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dtype_names() -> str:
    return ", ".join(str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES)

