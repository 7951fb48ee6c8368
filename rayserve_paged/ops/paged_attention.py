"""The attention backend interface and the torch reference backend over the paged KV cache.
(backends.py picks a backend by name; this module imports no other backend.)

Every backend keeps the invariant of `attention.py`: in each layer it writes the step's new
K/V into the cache first, then attends, so prefill and decode read keys and values only
through block tables. Grouped-query attention: query head h reads kv head h // group_size,
group_size = num_heads // num_kv_heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata
from .cache_ops import reshape_and_cache

_INDEX_DTYPES = (torch.int32, torch.int64)


class AttentionBackend:
    """What the model's attention layers call once per layer per step."""

    name: str = "abstract"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: the step's new keys
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding tokens' rows are zeros
        raise NotImplementedError

    def warm_up(self, key_cache, value_cache, num_heads: int, query_token_stride: int | None = None) -> list[str]:
        """Compile whatever the backend compiles lazily, before serving; returns what was run."""
        return []

    def decode_workspace_bytes(
        self, max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int, device
    ) -> int:
        """Device bytes one layer's decode may allocate beyond its inputs and outputs, at most
        (the KV-cache sizing reserves them; a profile run with prefills never sees them)."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# ---------------------------------------------------------------------------- torch reference


class TorchReferenceBackend(AttentionBackend):
    """Gathers each sequence's blocks by index and runs SDPA; correct on any device.

    Prefill loops over sequences in Python (lengths come from the metadata's host lists);
    decode is one batched SDPA over [num_decodes, max_decode_seq_len] with a length mask.
    """

    name = "torch"

    def forward(self, query, key, value, key_cache, value_cache, metadata, scale):
        check_attention_inputs(query, key, value, key_cache, value_cache, metadata)
        reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        output = torch.zeros_like(query)  # [num_tokens, num_heads, head_dim]
        num_prefill_tokens = metadata.num_prefill_tokens
        num_real_tokens = num_prefill_tokens + metadata.num_decode_tokens
        if metadata.num_prefills:
            _prefill_attention(
                query[:num_prefill_tokens], key_cache, value_cache, metadata, scale,
                out=output[:num_prefill_tokens],
            )
        if metadata.num_decodes:
            output[num_prefill_tokens:num_real_tokens] = _decode_attention(
                query[num_prefill_tokens:num_real_tokens], key_cache, value_cache, metadata, scale
            )
        return output


def _prefill_attention(query, key_cache, value_cache, metadata, scale, out) -> None:
    """Per sequence: new tokens attend causally to cached context + themselves."""
    query_lens, seq_lens = prefill_lengths_host(metadata)
    block_size = metadata.block_size
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        num_blocks = -(-seq_len // block_size)
        block_ids = metadata.prefill_block_tables[i, :num_blocks]  # [num_blocks]
        keys = _gather_sequence(key_cache, block_ids, seq_len)  # [seq_len, num_kv_heads, head_dim]
        values = _gather_sequence(value_cache, block_ids, seq_len)
        end = start + query_len
        out[start:end] = _causal_attention(query[start:end], keys, values, seq_len - query_len, scale)
        start = end


def _gather_sequence(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    _, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, block_ids)  # [num_blocks, block_size, num_kv_heads, head_dim]
    return blocks.reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, num_kv_heads, head_dim]


def _causal_attention(query, keys, values, context_len: int, scale: float) -> torch.Tensor:
    """query [q, num_heads, d]; keys/values [context_len + q, num_kv_heads, d] -> [q, num_heads, d].

    The query heads sharing a kv head are folded into the query-length axis, so SDPA sees
    [num_kv_heads, group_size * q, d] against [num_kv_heads, seq_len, d] with no K/V repeat.
    """
    query_len, num_heads, head_dim = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group_size = num_heads // num_kv_heads
    folded = (
        query.reshape(query_len, num_kv_heads, group_size, head_dim)
        .permute(1, 2, 0, 3)
        .reshape(num_kv_heads, group_size * query_len, head_dim)
    )  # [num_kv_heads, group_size * query_len, head_dim]
    positions = torch.arange(seq_len, device=query.device)  # [seq_len]
    query_positions = positions[context_len:, None]  # [query_len, 1]: absolute positions
    is_visible = positions[None, :] <= query_positions  # [query_len, seq_len]
    is_visible = is_visible.repeat(group_size, 1)  # [group_size * query_len, seq_len]
    attended = F.scaled_dot_product_attention(
        folded, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=is_visible, scale=scale
    )  # [num_kv_heads, group_size * query_len, head_dim]
    return (
        attended.reshape(num_kv_heads, group_size, query_len, head_dim)
        .permute(2, 0, 1, 3)
        .reshape(query_len, num_heads, head_dim)
    )


DECODE_CHUNK = 32  # sequences per padded batch: sorted by length, so padding stays small


def _decode_attention(query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
    """One query per sequence over its seq_len cached positions.

    Sequences are sorted by length and attended in chunks of DECODE_CHUNK, each padded only
    to its own longest: a batch of mixed lengths gathers (and masks) about the tokens it holds
    instead of num_decodes x the longest.
    """
    num_decodes = query.shape[0]
    lens = metadata.decode_seq_lens_host
    if lens is None:
        lens = metadata.decode_seq_lens.tolist()
    if num_decodes <= DECODE_CHUNK:
        return _decode_batch(query, key_cache, value_cache, metadata.decode_block_tables,
                             metadata.decode_seq_lens, max(lens), metadata.block_size, scale)  # fmt: skip
    order = sorted(range(num_decodes), key=lens.__getitem__)
    out = torch.empty_like(query)  # [num_decodes, num_heads, head_dim]
    for start in range(0, num_decodes, DECODE_CHUNK):
        chunk = order[start : start + DECODE_CHUNK]
        index = torch.tensor(chunk, device=query.device)
        out[index] = _decode_batch(
            query.index_select(0, index), key_cache, value_cache,
            metadata.decode_block_tables.index_select(0, index), metadata.decode_seq_lens.index_select(0, index),
            lens[chunk[-1]], metadata.block_size, scale,
        )  # fmt: skip
    return out


def _decode_batch(query, key_cache, value_cache, block_tables, seq_lens, max_len, block_size, scale):
    """Decode attention for sequences padded to max_len, with a length mask."""
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_blocks = -(-max_len // block_size)
    block_tables = block_tables[:, :num_blocks]  # [num_decodes, num_blocks]
    positions = torch.arange(max_len, device=query.device)  # [max_len]
    is_valid = positions[None, :] < seq_lens[:, None]  # [num_decodes, max_len]
    keys = _gather_batch(key_cache, block_tables, max_len, is_valid)  # [num_decodes, kv_heads, max_len, d]
    values = _gather_batch(value_cache, block_tables, max_len, is_valid)
    grouped = query.reshape(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    attended = F.scaled_dot_product_attention(
        grouped, keys, values, attn_mask=is_valid[:, None, None, :], scale=scale
    )  # [num_decodes, num_kv_heads, group_size, head_dim]
    return attended.reshape(num_decodes, num_heads, head_dim)


def _gather_batch(cache, block_tables, max_len: int, is_valid) -> torch.Tensor:
    """Blocks of every sequence, padded to max_len; positions past a sequence's end are zeroed
    (the cache there holds stale or never-written values, possibly NaN, which a mask alone
    would not stop: 0 * NaN is NaN)."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    num_seqs, num_blocks = block_tables.shape
    # [num_seqs * num_blocks, block_size, num_kv_heads, head_dim]
    blocks = cache.index_select(0, block_tables.reshape(-1))
    tokens = blocks.reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_len]
    # in place: `blocks` is a fresh gather, never the cache (an out-of-place fill allocated a
    # second padded copy each call and was the largest single cost of CPU decode)
    tokens.masked_fill_(~is_valid[:, :, None, None], 0)  # [num_seqs, max_len, kv_heads, d]
    return tokens.transpose(1, 2)  # [num_seqs, num_kv_heads, max_len, head_dim]


def prefill_lengths_host(metadata: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens) of the prefill sequences as host lists, from the metadata's
    host copies when present, else with one .tolist() each."""
    query_lens = metadata.prefill_query_lens_host
    if query_lens is None:
        query_lens = torch.diff(metadata.prefill_query_start_loc).tolist()
    seq_lens = metadata.prefill_seq_lens_host
    if seq_lens is None:
        seq_lens = metadata.prefill_seq_lens.tolist()
    return query_lens, seq_lens


# ---------------------------------------------------------------------------- input checks


def check_attention_inputs(query, key, value, key_cache, value_cache, metadata: AttentionMetadata) -> None:
    """Shapes, dtypes and devices of one forward call; raises ValueError naming the problem.

    reshape_and_cache checks key/value against the caches and the slot mapping itself.
    """
    _require(query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    _require(key.dim() == 3, f"key must be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)}")
    _require(key_cache.dim() == 4, f"key_cache must be 4-d, got {tuple(key_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    _require(
        key.shape[0] == num_tokens and key.shape[2] == head_dim,
        f"key {tuple(key.shape)} does not match query {tuple(query.shape)} in num_tokens or head_dim",
    )
    _require(
        num_heads % num_kv_heads == 0,
        f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}",
    )
    _require(query.dtype == key.dtype, f"query dtype {query.dtype} != key dtype {key.dtype}")
    _require(
        query.device == key_cache.device,
        f"query is on {query.device} but key_cache is on {key_cache.device}",
    )
    _require(
        metadata.block_size == key_cache.shape[1],
        f"metadata.block_size={metadata.block_size} != key_cache block_size={key_cache.shape[1]}",
    )
    _check_metadata(metadata, num_tokens, query.device)


def _check_metadata(metadata: AttentionMetadata, num_tokens: int, device: torch.device) -> None:
    num_real_tokens = metadata.num_prefill_tokens + metadata.num_decode_tokens
    _require(
        num_real_tokens <= num_tokens,
        f"num_prefill_tokens + num_decode_tokens = {num_real_tokens} > num_tokens = {num_tokens}",
    )
    _require(
        metadata.num_decode_tokens == metadata.num_decodes,
        f"num_decode_tokens={metadata.num_decode_tokens} != len(decode_seq_lens)={metadata.num_decodes}",
    )
    for name in (
        "prefill_query_start_loc", "prefill_context_lens", "prefill_seq_lens",
        "prefill_block_tables", "decode_seq_lens", "decode_block_tables",
    ):
        tensor = getattr(metadata, name)
        _require(tensor.dtype in _INDEX_DTYPES, f"metadata.{name} must be int32 or int64, got {tensor.dtype}")
        _require(tensor.device == device, f"metadata.{name} is on {tensor.device} but query is on {device}")
    _require(
        metadata.prefill_query_start_loc.shape == (metadata.num_prefills + 1,),
        f"metadata.prefill_query_start_loc must be [num_prefills + 1 = {metadata.num_prefills + 1}], "
        f"got {tuple(metadata.prefill_query_start_loc.shape)}",
    )
    query_lens_host = metadata.prefill_query_lens_host
    _require(
        query_lens_host is None or sum(query_lens_host) == metadata.num_prefill_tokens,
        f"metadata.prefill_query_lens_host sums to {sum(query_lens_host or [])}, "
        f"not num_prefill_tokens={metadata.num_prefill_tokens}",
    )
    _check_block_table(metadata, "prefill", metadata.max_prefill_seq_len, metadata.prefill_seq_lens_host)
    _check_block_table(metadata, "decode", metadata.max_decode_seq_len, metadata.decode_seq_lens_host)


def _check_block_table(metadata, part: str, max_seq_len: int, seq_lens_host: list[int] | None) -> None:
    block_tables = getattr(metadata, f"{part}_block_tables")
    num_seqs = getattr(metadata, f"num_{part}s")
    if num_seqs == 0:
        return
    _require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
        f"metadata.{part}_block_tables must be [num_{part}s={num_seqs}, max_blocks], "
        f"got {tuple(block_tables.shape)}",
    )
    capacity = block_tables.shape[1] * metadata.block_size
    _require(
        max_seq_len <= capacity,
        f"metadata.max_{part}_seq_len={max_seq_len} does not fit {part}_block_tables of "
        f"{block_tables.shape[1]} blocks x {metadata.block_size} tokens",
    )
    if seq_lens_host is not None:
        _require(
            len(seq_lens_host) == num_seqs and max(seq_lens_host) <= max_seq_len,
            f"metadata.{part}_seq_lens_host={seq_lens_host} disagrees with num_{part}s={num_seqs} "
            f"or max_{part}_seq_len={max_seq_len}",
        )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
