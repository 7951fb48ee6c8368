"""The attention backend interface and the torch reference backend over the paged KV cache.
(backends.py picks a backend by name; this module imports no other backend.)

Every backend keeps the invariant of `attention.py`: in each layer it writes the step's new
K/V into the cache first, then attends, so prefill and decode read keys and values only
through block tables.

A layer may ask for a sliding window W (the query at position p sees keys at p - W < k <= p,
as transformers masks them) and an attention logit soft-cap c (score s -> c * tanh(s / c),
after the scale, before the mask and softmax: Gemma 2). With a window no backend reads a
block that lies wholly before the window: the scheduler may have returned it to the pool. Grouped-query attention: query head h reads kv head h // group_size,
group_size = num_heads // num_kv_heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_decode
from .attention import AttentionMetadata
from .cache_ops import _check_reshape_and_cache, cpu_slot_writes, write_slots

_INDEX_DTYPES = (torch.int32, torch.int64)


class AttentionBackend:
    """What the model's attention layers call once per layer per step.

    Checks and launch planning happen once per step: `begin_step(metadata)` (the model
    runner calls it once the step's metadata is built) checks the metadata and makes the
    step's plan; the first layer checks its own inputs against it. Every later layer whose
    inputs have the same shapes, strides, dtypes and devices (one tuple comparison,
    `layer_signature`) only writes the cache and launches attention. A metadata object is
    never changed once built: the plan is keyed by its identity.
    """

    name: str = "abstract"
    # Whether a whole step's forward may be captured in a CUDA graph: no host read of a
    # device tensor, no host-side value baked into a launch that differs between steps of
    # the same shapes (worker/static_decode.py plans decode at max_model_len for it).
    supports_cuda_graphs: bool = False
    _plan: StepPlan | None = None

    def begin_step(self, metadata: AttentionMetadata) -> None:
        """Check the step's metadata (ValueError naming the problem) and plan its layers."""
        check_step_metadata(metadata)
        self._plan = self._new_plan(metadata)

    def _new_plan(self, metadata: AttentionMetadata) -> StepPlan:
        return StepPlan(metadata)

    def step_plan(self, metadata: AttentionMetadata) -> StepPlan:
        """The plan of the step `metadata` describes; a metadata begin_step has not seen begins a step."""
        plan = self._plan
        if plan is None or plan.metadata is not metadata:
            self.begin_step(metadata)
            plan = self._plan
        return plan

    def _layer_plan(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata) -> StepPlan:
        """The step's plan, with this layer's inputs checked: in full at the first layer of a
        step and at any layer whose signature differs from the last checked one, else by the
        signature comparison alone. A metadata begin_step has not seen begins a step."""
        plan = self.step_plan(metadata)
        signature = layer_signature(query, key, value, key_cache, value_cache)
        if signature != plan.layer_signature:
            self._check_layer(query, key, value, key_cache, value_cache, metadata)
            self._plan_layer(plan, query, key, value, key_cache)
            plan.layer_signature = signature
        return plan

    def _check_layer(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata) -> None:
        check_layer_inputs(query, key, value, key_cache, value_cache, metadata)

    def _plan_layer(self, plan: StepPlan, query, key, value, key_cache) -> None:
        """What the launches need beyond the metadata, from checked layer inputs (shapes, strides)."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: the step's new keys
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # a query sees only the last sliding_window positions
        soft_cap: float | None = None,  # scores s -> soft_cap * tanh(s / soft_cap) before the softmax
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding tokens' rows are zeros
        raise NotImplementedError

    def warm_up(self, key_cache, value_cache, num_heads: int, query_token_stride: int | None = None) -> list[str]:
        """Compile whatever the backend compiles lazily, before serving; returns what was run."""
        return []

    def add_layer(self, sliding_window: int | None, soft_cap: float | None) -> None:
        """Each attention layer says, once when built, whether it has a window and a soft-cap:
        the (has window, has cap) variants the model runs, which warm_up compiles."""
        self.layer_maskings = self.layer_maskings | {(sliding_window is not None, soft_cap is not None)}

    layer_maskings: frozenset[tuple[bool, bool]] = frozenset()

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
    """Paged attention in torch, with a compiled decode kernel on the CPU; correct on any device.

    prefill   a prompt with no cached context attends over its own new K/V with
              scaled_dot_product_attention(is_causal=True); one with cached context (prefix
              hit, recompute, a later prefill chunk) gathers only the context's blocks, once,
              and appends its new K/V
    decode    float32 on the CPU: the compiled kernel of cpu_decode.py reads each sequence's
              blocks in place (no gather, no padding); elsewhere, or without a compiler: a
              gather of token rows into a buffer reused across layers and steps, padding
              rows pointing at a real slot of the same sequence and masked out (no zero-fill),
              sequences sorted by length in chunks of DECODE_CHUNK, batched SDPA per chunk

    What depends only on the step (lengths, index tensors, masks, the input checks) is built
    once per step (begin_step, then at first use) and reused by every layer of that step.
    """

    name = "torch"

    def __init__(self, use_cpu_kernel: bool = True) -> None:
        self.use_cpu_kernel = use_cpu_kernel
        self._kernel: cpu_decode.PagedDecodeKernel | None = None
        self._kernel_checked = False
        self._gather_buffers: dict[tuple, torch.Tensor] = {}  # torch decode path, grown on demand

    def forward(self, query, key, value, key_cache, value_cache, metadata, scale, sliding_window=None, soft_cap=None):
        plan = self._layer_plan(query, key, value, key_cache, value_cache, metadata)
        writes = plan.cpu_slot_writes() if key_cache.device.type == "cpu" else None
        write_slots(key, value, key_cache, value_cache, metadata.slot_mapping, writes)
        output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        num_prefill_tokens, num_real_tokens = plan.num_prefill_tokens, plan.num_real_tokens
        if num_real_tokens < plan.num_tokens:
            output[num_real_tokens:] = 0  # padding tokens
        if metadata.num_prefills:
            _prefill_attention(
                query, key, value, key_cache, value_cache, plan, scale, sliding_window, soft_cap,
                out=output[:num_prefill_tokens],
            )
        if metadata.num_decodes:
            decode_query = plan.decode_rows(query)  # [num_decodes, num_heads, d]
            decode_out = plan.decode_rows(output)
            kernel = self._cpu_kernel(query.dtype, key_cache)
            if kernel is not None:
                tables, seq_lens = plan.kernel_inputs()
                kernel(
                    decode_out, decode_query.contiguous(), key_cache, value_cache, tables, seq_lens, scale,
                    sliding_window, soft_cap,
                )
            else:
                self._torch_decode(
                    decode_query, key_cache, value_cache, plan, scale, sliding_window, soft_cap, out=decode_out
                )
        return output

    def decodes_with_cpu_kernel(self, key_cache: torch.Tensor) -> bool:
        """Whether float32 decode over this cache runs the compiled kernel (what the compiled
        decoder layer of ops/cpu_layer.py runs in its place)."""
        return self._cpu_kernel(key_cache.dtype, key_cache) is not None

    def _cpu_kernel(self, dtype: torch.dtype, key_cache: torch.Tensor) -> cpu_decode.PagedDecodeKernel | None:
        """The compiled kernel for a decode in `dtype` over this cache, or None (the torch path)."""
        if not self.use_cpu_kernel or key_cache.device.type != "cpu" or dtype != torch.float32:
            return None
        if not self._kernel_checked:
            self._kernel = cpu_decode.load()
            self._kernel_checked = True
        return self._kernel if key_cache.is_contiguous() else None

    def _torch_decode(self, query, key_cache, value_cache, plan: StepPlan, scale, sliding_window, soft_cap, out) -> None:
        """Per length-sorted chunk: gather token rows into reused buffers, one masked SDPA."""
        num_heads, head_dim = query.shape[1:]
        _, _, num_kv_heads, _ = key_cache.shape
        flat_shape = (-1, num_kv_heads, head_dim)
        for chunk in plan.decode_chunks(query.device, sliding_window):
            num_seqs, max_len = chunk.slots.shape
            keys, values = self._buffers(num_seqs * max_len, key_cache)  # [n * max_len, kv_heads, d]
            torch.index_select(key_cache.view(flat_shape), 0, chunk.slots.view(-1), out=keys)
            torch.index_select(value_cache.view(flat_shape), 0, chunk.slots.view(-1), out=values)
            chunk_query = query if chunk.index is None else query.index_select(0, chunk.index)
            grouped = chunk_query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
            attended = masked_attention(
                grouped,
                keys.view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2),
                values.view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2),
                chunk.is_valid, scale, soft_cap,
            )  # [num_seqs, num_kv_heads, group_size, head_dim]
            attended = attended.reshape(num_seqs, num_heads, head_dim)
            if chunk.index is None:
                out.copy_(attended)
            else:
                out.index_copy_(0, chunk.index, attended)

    def _buffers(self, num_rows: int, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [num_rows, num_kv_heads, head_dim] views of buffers kept across layers and steps:
        no allocation (and no page zeroing by the OS) once the largest chunk has been seen."""
        key = (cache.device, cache.dtype, cache.shape[2], cache.shape[3])
        buffer = self._gather_buffers.get(key)
        if buffer is None or buffer.shape[1] < num_rows:
            buffer = torch.empty((2, num_rows, *cache.shape[2:]), dtype=cache.dtype, device=cache.device)
            self._gather_buffers[key] = buffer
        return buffer[0, :num_rows], buffer[1, :num_rows]


@dataclass(slots=True)
class _DecodeChunk:
    index: torch.Tensor | None  # [n] int64: rows of the step's decodes in this chunk; None = all, in order
    slots: torch.Tensor  # [n, max_len] int64: cache row of each position; masked -> the sequence's last slot
    is_valid: torch.Tensor  # [n, 1, 1, max_len] bool: seq_len - window <= position < seq_len


class StepPlan:
    """What every layer of one step shares: the checked layer signature, host lengths and
    the decode index tensors, each built on first use. Backends extend it with their launch
    plans."""

    def __init__(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        self.layer_signature: tuple | None = None  # of the last layer whose inputs were checked
        self.num_prefill_tokens = metadata.num_prefill_tokens
        self.num_real_tokens = metadata.num_prefill_tokens + metadata.num_decode_tokens
        self.num_tokens = metadata.slot_mapping.shape[0]
        self._decode_is_all = self.num_prefill_tokens == 0 and self.num_real_tokens == self.num_tokens
        self.prefill_query_lens, self.prefill_seq_lens = prefill_lengths_host(metadata)
        self._prefill_context_blocks: list[torch.Tensor | None] | None = None
        self._kernel_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cpu_slot_writes: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._decode_chunks: dict[int | None, list[_DecodeChunk]] = {}  # by sliding window

    def decode_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The decode tokens' rows of a [num_tokens, ...] tensor (itself in a decode-only step
        without padding: no slicing)."""
        return tensor if self._decode_is_all else tensor[self.num_prefill_tokens : self.num_real_tokens]

    def prefill_context_blocks(self) -> list[torch.Tensor | None]:
        """Per prefill sequence: the block ids holding its cached context, or None without one."""
        if self._prefill_context_blocks is None:
            block_size = self.metadata.block_size
            tables = self.metadata.prefill_block_tables
            self._prefill_context_blocks = [
                tables[i, : -(-(seq_len - query_len) // block_size)] if seq_len > query_len else None
                for i, (query_len, seq_len) in enumerate(zip(self.prefill_query_lens, self.prefill_seq_lens))
            ]
        return self._prefill_context_blocks

    def cpu_slot_writes(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """cache_ops.cpu_slot_writes of the step's slot mapping, built once for all layers."""
        if self._cpu_slot_writes is None:
            self._cpu_slot_writes = cpu_slot_writes(self.metadata.slot_mapping)
        return self._cpu_slot_writes

    def kernel_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables [num_decodes, max_blocks], seq_lens [num_decodes]) as contiguous int32."""
        if self._kernel_inputs is None:
            metadata = self.metadata
            self._kernel_inputs = (
                metadata.decode_block_tables.to(torch.int32).contiguous(),
                metadata.decode_seq_lens.to(torch.int32).contiguous(),
            )
        return self._kernel_inputs

    def decode_chunks(self, device: torch.device, sliding_window: int | None = None) -> list[_DecodeChunk]:
        chunks = self._decode_chunks.get(sliding_window)
        if chunks is None:
            chunks = self._decode_chunks[sliding_window] = self._build_decode_chunks(device, sliding_window)
        return chunks

    def _build_decode_chunks(self, device: torch.device, sliding_window: int | None) -> list[_DecodeChunk]:
        metadata = self.metadata
        lens = metadata.decode_seq_lens_host
        if lens is None:
            lens = metadata.decode_seq_lens.tolist()
        block_size = metadata.block_size
        tables = metadata.decode_block_tables.to(torch.int64)  # [num_decodes, max_blocks]
        num_decodes = len(lens)
        if num_decodes <= DECODE_CHUNK:
            groups = [list(range(num_decodes))]
        else:
            order = sorted(range(num_decodes), key=lens.__getitem__)
            groups = [order[i : i + DECODE_CHUNK] for i in range(0, num_decodes, DECODE_CHUNK)]
        chunks = []
        for rows in groups:
            max_len = max(lens[r] for r in rows)
            index = None if len(groups) == 1 else torch.tensor(rows, dtype=torch.int64, device=device)
            chunk_tables = tables if index is None else tables.index_select(0, index)
            seq_lens = torch.tensor([lens[r] for r in rows], dtype=torch.int64, device=device)  # [n]
            positions = torch.arange(max_len, device=device)  # [max_len]
            is_valid = positions[None, :] < seq_lens[:, None]  # [n, max_len]
            if sliding_window is not None:
                is_valid &= positions[None, :] >= seq_lens[:, None] - sliding_window
            # masked positions read the last position (written, and never outside a window): finite
            positions = torch.where(is_valid, positions[None, :], seq_lens[:, None] - 1)  # [n, max_len]
            blocks = chunk_tables.gather(1, positions // block_size)  # [n, max_len]
            slots = blocks * block_size + positions % block_size
            chunks.append(_DecodeChunk(index, slots, is_valid[:, None, None, :]))
        return chunks


def _prefill_attention(
    query, key, value, key_cache, value_cache, plan: StepPlan, scale, sliding_window, soft_cap, out
) -> None:
    """Per sequence: new tokens attend causally to cached context + themselves. The new
    tokens' K/V come from the step's own key/value; only the context is read from the cache,
    from the first block the window reaches into."""
    start = 0
    context_blocks = plan.prefill_context_blocks()
    block_size = plan.metadata.block_size
    for i, (query_len, seq_len) in enumerate(zip(plan.prefill_query_lens, plan.prefill_seq_lens)):
        end = start + query_len
        keys, values = key[start:end], value[start:end]  # [query_len, num_kv_heads, head_dim]
        context_len = seq_len - query_len
        if context_len == 0 and sliding_window is None and soft_cap is None:
            out[start:end] = _self_attention(query[start:end], keys, values, scale)
        else:
            # keys from `first` on: the block holding the first query's oldest visible key
            first = 0 if sliding_window is None else max(0, context_len + 1 - sliding_window) // block_size * block_size
            if context_len > first:
                blocks = context_blocks[i][first // block_size :]
                keys = torch.cat((_gather_sequence(key_cache, blocks, context_len - first), keys))
                values = torch.cat((_gather_sequence(value_cache, blocks, context_len - first), values))
            out[start:end] = _causal_attention(
                query[start:end], keys, values, context_len - first, scale, sliding_window, soft_cap
            )
        start = end


def _self_attention(query, keys, values, scale: float) -> torch.Tensor:
    """Causal attention of a fresh prompt over its own K/V: [q, num_heads, d] -> [q, num_heads, d]."""
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        is_causal=True, scale=scale, enable_gqa=True,
    )  # [num_heads, query_len, head_dim]  # fmt: skip
    return attended.transpose(0, 1)


def _gather_sequence(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    _, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, block_ids)  # [num_blocks, block_size, num_kv_heads, head_dim]
    return blocks.reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, num_kv_heads, head_dim]


def _causal_attention(
    query, keys, values, context_len: int, scale: float, sliding_window: int | None = None, soft_cap: float | None = None
) -> torch.Tensor:
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
    query_positions = positions[context_len:, None]  # [query_len, 1]: positions from the first key
    is_visible = positions[None, :] <= query_positions  # [query_len, seq_len]
    if sliding_window is not None:
        is_visible &= positions[None, :] > query_positions - sliding_window
    is_visible = is_visible.repeat(group_size, 1)  # [group_size * query_len, seq_len]
    attended = masked_attention(
        folded, keys.transpose(0, 1), values.transpose(0, 1), is_visible, scale, soft_cap
    )  # [num_kv_heads, group_size * query_len, head_dim]
    return (
        attended.reshape(num_kv_heads, group_size, query_len, head_dim)
        .permute(2, 0, 1, 3)
        .reshape(query_len, num_heads, head_dim)
    )


def masked_attention(query, keys, values, is_visible, scale: float, soft_cap: float | None) -> torch.Tensor:
    """softmax(cap(scale * q k^T), masked) v over the last two dims; SDPA without a soft-cap.
    query [..., q, d]; keys / values [..., k, d]; is_visible broadcasts to [..., q, k]."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=is_visible, scale=scale)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale  # [..., q, k]
    scores = torch.tanh(scores / soft_cap) * soft_cap
    probs = scores.masked_fill(~is_visible, float("-inf")).softmax(dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(values.dtype), values)  # [..., q, d]


DECODE_CHUNK = 32  # torch decode path: sequences per padded batch, sorted by length


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


def layer_signature(query, key, value, key_cache, value_cache) -> tuple:
    """Shapes, strides, dtypes and devices of one layer's inputs: what check_layer_inputs
    and the launch plans depend on, so equal signatures pass the same checks."""
    return (
        query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(),
        key_cache.shape, key_cache.stride(), value_cache.shape, value_cache.stride(),
        query.dtype, key.dtype, value.dtype, key_cache.dtype, value_cache.dtype,
        query.get_device(), key.get_device(), value.get_device(), key_cache.get_device(), value_cache.get_device(),
    )  # fmt: skip


def check_attention_inputs(query, key, value, key_cache, value_cache, metadata: AttentionMetadata) -> None:
    """check_step_metadata + check_layer_inputs: everything one forward call needs."""
    check_step_metadata(metadata)
    check_layer_inputs(query, key, value, key_cache, value_cache, metadata)


def check_layer_inputs(query, key, value, key_cache, value_cache, metadata: AttentionMetadata) -> None:
    """One layer's tensors against each other and the step's metadata (its cache write
    included); raises ValueError naming the problem."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if key.dim() != 3:
        raise ValueError(f"key must be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)}")
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be 4-d, got {tuple(key_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if not (key.shape[0] == num_tokens and key.shape[2] == head_dim):
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)} in num_tokens or head_dim")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if query.dtype != key.dtype:
        raise ValueError(f"query dtype {query.dtype} != key dtype {key.dtype}")
    if query.device != key_cache.device:
        raise ValueError(f"query is on {query.device} but key_cache is on {key_cache.device}")
    if metadata.block_size != key_cache.shape[1]:
        raise ValueError(f"metadata.block_size={metadata.block_size} != key_cache block_size={key_cache.shape[1]}")
    if query.device != metadata.slot_mapping.device:
        raise ValueError(f"query is on {query.device} but the step's metadata is on {metadata.slot_mapping.device}")
    _check_reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)


def check_step_metadata(metadata: AttentionMetadata) -> None:
    """The step's metadata alone (once per step, before any layer); raises ValueError naming
    the problem. Reads no device tensor."""
    if metadata.slot_mapping.dim() != 1:
        raise ValueError(f"metadata.slot_mapping must be [num_tokens], got {tuple(metadata.slot_mapping.shape)}")
    num_tokens, device = metadata.slot_mapping.shape[0], metadata.slot_mapping.device
    num_real_tokens = metadata.num_prefill_tokens + metadata.num_decode_tokens
    if not (num_real_tokens <= num_tokens):
        raise ValueError(f"num_prefill_tokens + num_decode_tokens = {num_real_tokens} > num_tokens = {num_tokens}")
    if metadata.num_decode_tokens != metadata.num_decodes:
        raise ValueError(f"num_decode_tokens={metadata.num_decode_tokens} != len(decode_seq_lens)={metadata.num_decodes}")
    for name in (
        "prefill_query_start_loc", "prefill_context_lens", "prefill_seq_lens",
        "prefill_block_tables", "decode_seq_lens", "decode_block_tables",
    ):
        tensor = getattr(metadata, name)
        if tensor.dtype not in _INDEX_DTYPES:
            raise ValueError(f"metadata.{name} must be int32 or int64, got {tensor.dtype}")
        if tensor.device != device:
            raise ValueError(f"metadata.{name} is on {tensor.device} but metadata.slot_mapping is on {device}")
    if metadata.prefill_query_start_loc.shape != (metadata.num_prefills + 1,):
        raise ValueError(
            f"metadata.prefill_query_start_loc must be [num_prefills + 1 = {metadata.num_prefills + 1}], "
            f"got {tuple(metadata.prefill_query_start_loc.shape)}"
        )
    query_lens_host = metadata.prefill_query_lens_host
    if not (query_lens_host is None or sum(query_lens_host) == metadata.num_prefill_tokens):
        raise ValueError(
            f"metadata.prefill_query_lens_host sums to {sum(query_lens_host or [])}, "
            f"not num_prefill_tokens={metadata.num_prefill_tokens}"
        )
    _check_block_table(metadata, "prefill", metadata.max_prefill_seq_len, metadata.prefill_seq_lens_host)
    _check_block_table(metadata, "decode", metadata.max_decode_seq_len, metadata.decode_seq_lens_host)


def _check_block_table(metadata, part: str, max_seq_len: int, seq_lens_host: list[int] | None) -> None:
    block_tables = getattr(metadata, f"{part}_block_tables")
    num_seqs = getattr(metadata, f"num_{part}s")
    if num_seqs == 0:
        return
    if not (block_tables.dim() == 2 and block_tables.shape[0] == num_seqs):
        raise ValueError(
            f"metadata.{part}_block_tables must be [num_{part}s={num_seqs}, max_blocks], "
            f"got {tuple(block_tables.shape)}"
        )
    capacity = block_tables.shape[1] * metadata.block_size
    if not (max_seq_len <= capacity):
        raise ValueError(
            f"metadata.max_{part}_seq_len={max_seq_len} does not fit {part}_block_tables of "
            f"{block_tables.shape[1]} blocks x {metadata.block_size} tokens"
        )
    if seq_lens_host is not None:
        if not (len(seq_lens_host) == num_seqs and max(seq_lens_host) <= max_seq_len):
            raise ValueError(
                f"metadata.{part}_seq_lens_host={seq_lens_host} disagrees with num_{part}s={num_seqs} "
                f"or max_{part}_seq_len={max_seq_len}"
            )

