"""Builders of paged-attention batches for the ops tests (the triton tests reuse them).

    from .builders import make_metadata, make_attention_inputs

make_metadata(prefills=(), decodes=(), *, block_size, generator, num_blocks=None,
              num_pad_tokens=0, device="cpu", with_host_lists=True) -> PagedBatch
    prefills: [(context_len, num_new_tokens), ...]  prefill sequences, in packing order;
              context_len > 0 is a prefix-cache hit or a recompute
    decodes:  [context_len, ...]  decode sequences: context_len cached tokens + 1 new token
    Each sequence gets distinct blocks drawn at random from a pool of num_blocks (default:
    what the batch needs + 4 spare); position p of a sequence lives in slot
    table[p // block_size] * block_size + p % block_size. num_pad_tokens PAD_SLOT tokens
    follow the real ones. Metadata tensors follow attention.py (int64 slots, int32 rest).

make_attention_inputs(batch, *, num_heads, num_kv_heads, head_dim, generator,
                      dtype=torch.float32) -> AttentionInputs
    Random query and new key/value for the step, each sequence's whole K/V history, and
    caches poisoned with NaN in which only the context tokens are written: the new tokens'
    slots stay NaN until the backend writes them.

group_quantized(out_features, in_features, bits, group_size, seed) -> (codes, scales, offsets, weight)
    Random group-quantized weight (the quantized GEMM tests): uint8 codes [out, in], float32
    scales / offsets [out, in / g] and the float32 weight they dequantize to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rayserve_paged.ops.attention import PAD_SLOT, AttentionMetadata
from rayserve_paged.ops.cache_ops import slot_of


@dataclass(slots=True)
class PagedBatch:
    metadata: AttentionMetadata
    context_lens: list[int]  # per sequence, prefills then decodes
    query_lens: list[int]  # new tokens per sequence (1 for each decode)
    block_tables: list[list[int]]  # per sequence, exactly ceil(seq_len / block_size) ids
    block_size: int
    num_blocks: int
    num_pad_tokens: int
    device: torch.device

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    @property
    def num_real_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.num_real_tokens + self.num_pad_tokens


@dataclass(slots=True)
class AttentionInputs:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: the step's new keys
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    key_history: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    value_history: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]


def make_metadata(
    prefills: Sequence[tuple[int, int]] = (),
    decodes: Sequence[int] = (),
    *,
    block_size: int,
    generator: torch.Generator,
    num_blocks: int | None = None,
    num_pad_tokens: int = 0,
    device: torch.device | str = "cpu",
    with_host_lists: bool = True,
) -> PagedBatch:
    context_lens = [c for c, _ in prefills] + list(decodes)
    query_lens = [n for _, n in prefills] + [1] * len(decodes)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = num_blocks if num_blocks is not None else sum(blocks_needed) + 4
    assert sum(blocks_needed) <= num_blocks, "the pool is too small for the batch"
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = []
    for count in blocks_needed:
        block_tables.append(pool[:count])
        pool = pool[count:]
    batch = PagedBatch(
        metadata=None, context_lens=context_lens, query_lens=query_lens, block_tables=block_tables,
        block_size=block_size, num_blocks=num_blocks, num_pad_tokens=num_pad_tokens,
        device=torch.device(device),
    )
    batch.metadata = _build_metadata(batch, len(prefills), with_host_lists)
    return batch


def _build_metadata(batch: PagedBatch, num_prefills: int, with_host_lists: bool) -> AttentionMetadata:
    device = batch.device
    seq_lens, query_lens = batch.seq_lens, batch.query_lens
    prefill_query_lens = query_lens[:num_prefills]
    prefill_seq_lens = seq_lens[:num_prefills]
    decode_seq_lens = seq_lens[num_prefills:]
    slots = new_token_slots(batch) + [PAD_SLOT] * batch.num_pad_tokens

    def int32(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),  # [num_tokens]
        num_prefill_tokens=sum(prefill_query_lens),
        num_decode_tokens=len(decode_seq_lens),
        block_size=batch.block_size,
        prefill_query_start_loc=int32([0] + _cumsum(prefill_query_lens)),  # [num_prefills + 1]
        prefill_context_lens=int32(batch.context_lens[:num_prefills]),  # [num_prefills]
        prefill_seq_lens=int32(prefill_seq_lens),  # [num_prefills]
        prefill_block_tables=_padded_tables(batch.block_tables[:num_prefills], device),
        max_prefill_query_len=max(prefill_query_lens, default=0),
        max_prefill_seq_len=max(prefill_seq_lens, default=0),
        decode_seq_lens=int32(decode_seq_lens),  # [num_decodes]
        decode_block_tables=_padded_tables(batch.block_tables[num_prefills:], device),
        max_decode_seq_len=max(decode_seq_lens, default=0),
        prefill_query_lens_host=prefill_query_lens if with_host_lists else None,
        prefill_seq_lens_host=prefill_seq_lens if with_host_lists else None,
        decode_seq_lens_host=decode_seq_lens if with_host_lists else None,
    )


def new_token_slots(batch: PagedBatch) -> list[int]:
    """Slots of the step's real tokens, in packing order."""
    slots = []
    for table, context_len, query_len in zip(batch.block_tables, batch.context_lens, batch.query_lens):
        slots += slots_of(table, range(context_len, context_len + query_len), batch.block_size)
    return slots


def slots_of(table: list[int], positions, block_size: int) -> list[int]:
    return [slot_of(table, p, block_size) for p in positions]


def counted(calls: dict[str, int], name: str, fn):
    """`fn`, counting its calls in calls[name] (for monkeypatching a check)."""

    def wrapper(*args):
        calls[name] += 1
        return fn(*args)

    return wrapper


def _padded_tables(tables: list[list[int]], device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=1)
    rows = [t + [0] * (width - len(t)) for t in tables]
    tables = torch.tensor(rows, dtype=torch.int32, device=device)
    return tables.reshape(len(rows), width)  # [num_seqs, width]: reshape keeps [0, width] when empty


def _cumsum(values: list[int]) -> list[int]:
    total, sums = 0, []
    for value in values:
        total += value
        sums.append(total)
    return sums


def make_attention_inputs(
    batch: PagedBatch,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> AttentionInputs:
    def randn(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=batch.device)

    key_history = [randn(s, num_kv_heads, head_dim) for s in batch.seq_lens]  # [seq_len, kv_heads, d]
    value_history = [randn(s, num_kv_heads, head_dim) for s in batch.seq_lens]
    cache_shape = (batch.num_blocks, batch.block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=batch.device)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=batch.device)
    _write_context(key_cache, key_history, batch)
    _write_context(value_cache, value_history, batch)
    pad_kv = [randn(batch.num_pad_tokens, num_kv_heads, head_dim) for _ in range(2)]
    return AttentionInputs(
        query=randn(batch.num_tokens, num_heads, head_dim),  # [num_tokens, num_heads, head_dim]
        key=torch.cat(_new_tokens(key_history, batch) + [pad_kv[0]]),  # [num_tokens, kv_heads, d]
        value=torch.cat(_new_tokens(value_history, batch) + [pad_kv[1]]),
        key_cache=key_cache,
        value_cache=value_cache,
        key_history=key_history,
        value_history=value_history,
    )


def _new_tokens(history: list[torch.Tensor], batch: PagedBatch) -> list[torch.Tensor]:
    return [h[c:] for h, c in zip(history, batch.context_lens)]


def _write_context(cache: torch.Tensor, history: list[torch.Tensor], batch: PagedBatch) -> None:
    flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, kv_heads, d]
    for table, context_len, tokens in zip(batch.block_tables, batch.context_lens, history):
        slots = slots_of(table, range(context_len), batch.block_size)
        flat[torch.tensor(slots, dtype=torch.int64, device=cache.device)] = tokens[:context_len]


def group_quantized(out_features: int, in_features: int, bits: int, group_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    codes = torch.randint(0, 2**bits, (out_features, in_features), generator=g).to(torch.uint8)
    scales = torch.rand(out_features, groups, generator=g) * 0.02 + 0.001
    offsets = -scales * 2 ** (bits - 1) + torch.randn(out_features, groups, generator=g) * 0.01
    weight = codes.float().view(out_features, groups, group_size) * scales[..., None] + offsets[..., None]
    return codes, scales, offsets, weight.view(out_features, in_features)
