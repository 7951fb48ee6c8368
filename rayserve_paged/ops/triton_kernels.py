"""Triton kernels over the paged KV cache. Launch them through `triton_backend.py`, whose
wrappers check every input first; nothing here checks anything.

Cache layout, per layer (keys and values alike; see cache_ops.py):

    cache [num_blocks, block_size, num_kv_heads, head_dim]     contiguous
    token at position p of a sequence  ->  cache[table[p // block_size], p % block_size]

Attention kernels walk a sequence's keys in tiles of TILE_N tokens. A tile may span several
cache blocks (TILE_N >= block_size), so each key row finds its own block through the
block table; block size and tile size are independent. Per tile, online softmax (base 2):

    s     = (q . k) * scale * log2(e)                  [rows, TILE_N], -inf where not visible
    m_new = max(m, rowmax(s))
    acc   = acc * 2^(m - m_new) + 2^(s - m_new) @ v    l = l * 2^(m - m_new) + rowsum(2^(s - m_new))
    out   = acc / l                                     after the last tile

Cache strides are not arguments: the caches are contiguous (the wrappers check it), so a
slot's offset is built from the constexprs NUM_KV_HEADS, HEAD_DIM and BLOCK_SIZE. The
compiler then knows every K/V row starts at a multiple of HEAD_DIM elements and vectorizes
the loads (a runtime stride of 72 is not divisible by 16, and the launcher's specialization
would otherwise fall back to 2-byte loads).

Step-varying integers (the block-table width, the number of partitions) are listed in
`do_not_specialize` (and so is a layer's sliding window): Triton would otherwise compile a new variant whenever such a value
changes between 1, a multiple of 16 and anything else, i.e. while serving.

Grouped-query attention: the GROUP_SIZE query heads that share one kv head are rows of the
same tile, so each K/V tile is loaded once per kv head, not once per query head.

Head sizes that are not powers of two (80, 96) run padded to HEAD_PAD = next power of two,
with the extra lanes masked to zero on load and never stored. Rows are padded to at least
16 so every tl.dot meets the GPU's minimum shape.

DOT_DTYPE is the operand type of tl.dot: the cache dtype, except float32 (run with IEEE
precision, not TF32) and bfloat16 under TRITON_INTERPRET=1 (the interpreter multiplies
bfloat16 bit patterns as integers in tl.dot, so the wrapper asks for float32 there).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)


# ---------------------------------------------------------------------------- attention core


@triton.jit
def _attend_key_range(
    q,  # [BLOCK_M, HEAD_PAD] in DOT_DTYPE; rows are (query token, query head) pairs
    query_pos,  # [BLOCK_M] int32: absolute position of each row's token (used when CAUSAL)
    acc,  # [BLOCK_M, HEAD_PAD] float32
    m_i,  # [BLOCK_M] float32: running max of the scaled scores (log2 domain)
    l_i,  # [BLOCK_M] float32: running sum of 2^(s - m_i)
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,  # this sequence's row of the block table
    kv_head,
    key_start,  # first key position to read
    key_end,  # one past the last key position to read
    scale_log2,  # softmax scale * log2(e)
    window,  # SLIDING and CAUSAL: row r sees keys > query_pos[r] - window
    cap_log2,  # SOFT_CAP: soft-cap * log2(e)
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold keys [key_start, key_end) into (acc, m_i, l_i). Positions outside that range are
    never read (masked loads), so stale or NaN cache contents there (or blocks before a
    sliding window, which may be back in the pool) cannot leak into the result.

    SOFT_CAP: s -> cap * tanh(s / cap) on the natural-log scores; in the log2 domain that is
    cap_log2 * tanh(s / cap_log2), with tanh(x) = 2 * sigmoid(2x) - 1."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    is_real_lane = offs_d < HEAD_DIM  # [HEAD_PAD]
    head_offset = kv_head * HEAD_DIM
    for tile_start in range(key_start, key_end, TILE_N):
        key_pos = tile_start + offs_n  # [TILE_N]
        is_key = key_pos < key_end
        block_ids = tl.load(table_ptr + key_pos // BLOCK_SIZE, mask=is_key, other=0).to(tl.int64)
        row_offsets = block_ids * (BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM) + (key_pos % BLOCK_SIZE) * (
            NUM_KV_HEADS * HEAD_DIM
        ) + head_offset
        kv_offsets = row_offsets[:, None] + offs_d[None, :]  # [TILE_N, HEAD_PAD]
        kv_mask = is_key[:, None] & is_real_lane[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [TILE_N, HEAD_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        if SOFT_CAP:
            s = cap_log2 * (2.0 * tl.sigmoid(2.0 * s / cap_log2) - 1.0)
        is_visible = is_key[None, :]
        if CAUSAL:
            is_visible = is_visible & (key_pos[None, :] <= query_pos[:, None])
            if SLIDING:
                is_visible = is_visible & (key_pos[None, :] > query_pos[:, None] - window)
        s = tl.where(is_visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [TILE_N, HEAD_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _load_decode_query(
    q_ptr, seq, kv_head, stride_q_token, stride_q_head,
    GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """The query heads of one kv head for one decode token: [GROUP_PAD, HEAD_PAD], pad rows 0."""
    rows = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    heads = kv_head * GROUP_SIZE + rows  # [GROUP_PAD]
    mask = (rows < GROUP_SIZE)[:, None] & (offs_d < HEAD_DIM)[None, :]
    offsets = seq.to(tl.int64) * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :]
    return tl.load(q_ptr + offsets, mask=mask, other=0.0).to(DOT_DTYPE)


# ---------------------------------------------------------------------------- decode


@triton.jit(do_not_specialize=["stride_table_seq", "window"])
def paged_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    scale_log2,
    window,
    cap_log2,
    stride_q_token, stride_q_head,
    stride_out_token, stride_out_head,
    stride_table_seq,
    NUM_KV_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (num_seqs, num_kv_heads): one program per (sequence, kv head) walks the whole
    context (its last `window` positions when SLIDING) and writes the GROUP_SIZE query heads
    of that kv head."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    q = _load_decode_query(
        q_ptr, seq, kv_head, stride_q_token, stride_q_head, GROUP_SIZE, GROUP_PAD, HEAD_DIM, HEAD_PAD, DOT_DTYPE
    )
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    unused_pos = tl.zeros([GROUP_PAD], dtype=tl.int32)
    key_start = 0
    if SLIDING:
        key_start = tl.maximum(seq_len - window, 0)
    acc, m_i, l_i = _attend_key_range(
        q, unused_pos, acc, m_i, l_i, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_table_seq, kv_head, key_start, seq_len, scale_log2,
        window, cap_log2, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, False, SLIDING, SOFT_CAP,
        DOT_DTYPE, DOT_PRECISION,
    )
    rows = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    heads = kv_head * GROUP_SIZE + rows
    mask = (rows < GROUP_SIZE)[:, None] & (offs_d < HEAD_DIM)[None, :]
    offsets = seq.to(tl.int64) * stride_out_token + heads[:, None] * stride_out_head + offs_d[None, :]
    tl.store(out_ptr + offsets, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_table_seq", "max_partitions", "window"])
def paged_decode_partition_kernel(
    partial_out_ptr,  # [num_seqs, num_heads, max_partitions, HEAD_PAD] float32
    max_logits_ptr,  # [num_seqs, num_heads, max_partitions] float32 (log2 domain)
    exp_sums_ptr,  # [num_seqs, num_heads, max_partitions] float32
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scale_log2,
    window,
    cap_log2,
    stride_q_token, stride_q_head,
    stride_table_seq,
    num_heads,
    max_partitions,
    NUM_KV_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (num_seqs, num_kv_heads, max_partitions): keys [p * PARTITION_SIZE, (p + 1) *
    PARTITION_SIZE) of one sequence; writes the partition's normalised output, row max and
    row sum. Partitions past a sequence's end, or wholly before its window, write nothing
    (the reduce skips them)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    key_start = partition * PARTITION_SIZE
    key_end = tl.minimum(key_start + PARTITION_SIZE, seq_len)
    if SLIDING:
        key_start = tl.maximum(key_start, seq_len - window)
    if key_start >= key_end:
        return
    q = _load_decode_query(
        q_ptr, seq, kv_head, stride_q_token, stride_q_head, GROUP_SIZE, GROUP_PAD, HEAD_DIM, HEAD_PAD, DOT_DTYPE
    )
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    unused_pos = tl.zeros([GROUP_PAD], dtype=tl.int32)
    acc, m_i, l_i = _attend_key_range(
        q, unused_pos, acc, m_i, l_i, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_table_seq, kv_head, key_start, key_end, scale_log2,
        window, cap_log2, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, False, SLIDING, SOFT_CAP,
        DOT_DTYPE, DOT_PRECISION,
    )
    rows = tl.arange(0, GROUP_PAD)
    is_row = rows < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + rows  # [GROUP_PAD]
    # index of (seq, head, partition) in the [num_seqs, num_heads, max_partitions] buffers
    stat_index = (seq.to(tl.int64) * num_heads + heads) * max_partitions + partition
    tl.store(max_logits_ptr + stat_index, m_i, mask=is_row)
    tl.store(exp_sums_ptr + stat_index, l_i, mask=is_row)
    offs_d = tl.arange(0, HEAD_PAD)
    tl.store(
        partial_out_ptr + stat_index[:, None] * HEAD_PAD + offs_d[None, :],
        acc / l_i[:, None],
        mask=is_row[:, None],
    )


@triton.jit(do_not_specialize=["max_partitions", "window"])
def paged_decode_reduce_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_out_ptr,
    max_logits_ptr,
    exp_sums_ptr,
    seq_lens_ptr,
    window,
    stride_out_token, stride_out_head,
    num_heads,
    max_partitions,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    PARTITION_CHUNK: tl.constexpr,
    SLIDING: tl.constexpr,
):
    """Grid (num_seqs, num_heads): combine a sequence's partitions for one query head,
    weighting each partition's normalised output by 2^(m_p - max_p m_p) * l_p.

    Partitions are read PARTITION_CHUNK at a time with a running maximum (the same online
    rescaling as the attention loop), so one compiled variant serves any number of
    partitions: the count changes every step and must not be a compile-time constant."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    num_partitions = tl.cdiv(seq_len, PARTITION_SIZE)
    first_partition = 0
    if SLIDING:
        first_partition = tl.maximum(seq_len - window, 0) // PARTITION_SIZE
    base = (seq.to(tl.int64) * num_heads + head) * max_partitions
    offs_c = tl.arange(0, PARTITION_CHUNK)
    offs_d = tl.arange(0, HEAD_PAD)
    m_run = tl.full([1], float("-inf"), dtype=tl.float32)
    weight_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for start in range(first_partition, num_partitions, PARTITION_CHUNK):
        offs_p = start + offs_c
        is_partition = offs_p < num_partitions
        m = tl.load(max_logits_ptr + base + offs_p, mask=is_partition, other=float("-inf"))  # [CHUNK]
        l = tl.load(exp_sums_ptr + base + offs_p, mask=is_partition, other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))  # finite: the chunk holds at least one partition
        alpha = tl.exp2(m_run - m_new)  # 0 on the first chunk
        weights = tl.exp2(m - m_new) * l  # 0 for missing partitions
        partial = tl.load(
            partial_out_ptr + (base + offs_p)[:, None] * HEAD_PAD + offs_d[None, :],
            mask=is_partition[:, None],
            other=0.0,
        )  # [CHUNK, HEAD_PAD]
        acc = acc * alpha + tl.sum(partial * weights[:, None], 0)
        weight_sum = weight_sum * alpha + tl.sum(weights, 0)
        m_run = m_new
    out = acc / weight_sum  # [HEAD_PAD]
    offsets = seq.to(tl.int64) * stride_out_token + head * stride_out_head + offs_d
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# ---------------------------------------------------------------------------- prefill


@triton.jit(do_not_specialize=["stride_table_seq", "window"])
def paged_prefill_kernel(
    out_ptr,  # [num_prefill_tokens, num_heads, head_dim]
    q_ptr,  # [num_prefill_tokens, num_heads, head_dim]
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,  # [num_prefills, max_blocks]
    query_start_loc_ptr,  # [num_prefills + 1]
    context_lens_ptr,  # [num_prefills]
    scale_log2,
    window,
    cap_log2,
    stride_q_token, stride_q_head,
    stride_out_token, stride_out_head,
    stride_table_seq,
    NUM_KV_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (cdiv(max_query_len, BLOCK_Q), num_prefills, num_kv_heads).

    A program takes BLOCK_Q new tokens of one sequence times the GROUP_SIZE query heads of
    one kv head, as BLOCK_M = BLOCK_Q * GROUP_SIZE (+ padding) rows:

        row r -> token first + r // GROUP_SIZE, head kv_head * GROUP_SIZE + r % GROUP_SIZE

    and reads keys [0, context_len + last token + 1) through the block table: the cached
    context and the step's new tokens alike (the backend wrote those into the cache first).
    Token i of the new tokens sits at position context_len + i and sees keys <= that (and,
    when SLIDING, > that - window: the tile then starts at its first row's oldest visible key).
    """
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - query_start
    first = q_tile * BLOCK_Q
    if first >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP_SIZE  # [BLOCK_M]: index among this sequence's new tokens
    heads = kv_head * GROUP_SIZE + rows % GROUP_SIZE
    is_row = (rows < BLOCK_Q * GROUP_SIZE) & (token < query_len)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = is_row[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_offsets = (query_start + token).to(tl.int64)[:, None] * stride_q_token + heads[:, None] * stride_q_head
    q = tl.load(q_ptr + q_offsets + offs_d[None, :], mask=mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_PAD]
    query_pos = context_len + token  # [BLOCK_M]
    key_end = context_len + tl.minimum(query_len, first + BLOCK_Q)  # past the tile's last visible key
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    key_start = 0
    if SLIDING:
        key_start = tl.maximum(context_len + first + 1 - window, 0)
    acc, m_i, l_i = _attend_key_range(
        q, query_pos, acc, m_i, l_i, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_table_seq, kv_head, key_start, key_end, scale_log2,
        window, cap_log2, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, True, SLIDING, SOFT_CAP,
        DOT_DTYPE, DOT_PRECISION,
    )
    out_offsets = (query_start + token).to(tl.int64)[:, None] * stride_out_token + heads[:, None] * stride_out_head
    tl.store(
        out_ptr + out_offsets + offs_d[None, :], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask
    )


# ---------------------------------------------------------------------------- cache writes


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    stride_key_token, stride_key_head,
    stride_value_token, stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Grid (num_tokens,): copy one token's [num_kv_heads, head_dim] key and value into its
    slot; a negative slot (PAD_SLOT) writes nothing. Plain loads and stores: bit-exact."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    cache_offsets = (
        block * (BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM) + offset * (NUM_KV_HEADS * HEAD_DIM)
        + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    )  # [HEADS_PAD, HEAD_PAD]
    key = tl.load(key_ptr + token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + offs_h[:, None] * stride_value_head + offs_d[None, :], mask=mask
    )
    tl.store(v_cache_ptr + cache_offsets, value, mask=mask)
