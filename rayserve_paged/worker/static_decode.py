"""Static-shape decode: padded buckets, persistent inputs, one CUDA graph per bucket.

A decode-only step of n sequences runs as a batch of `bucket(n)` rows, the smallest of
`decode_buckets(max_num_seqs)` that holds n. Its inputs live in persistent buffers
(token ids, positions, slot mapping, sequence lengths, block tables, and for a model whose
RoPE depends on a length (dynamic NTK, LongRoPE) each row's RoPE length) sized for the largest
bucket, so every step of one bucket has the same shapes and the same addresses, and one
CUDA graph per bucket, captured at start-up, replays the whole model forward.

    rows      0 .......... n-1 | n .......... bucket-1
              the step's decodes | padding: token 0 at position 0, slot PAD_SLOT (writes
                                 | nothing), sequence length 1 over block 0 (reads one
                                 | cached slot: finite, never NaN), block-table row of zeros

The attention plan of a bucket is static too: `max_decode_seq_len` is `max_model_len`
(the block tables are `ceil(max_model_len / block_size)` wide), so a backend that chooses
its decode variant and partition count from `max_decode_seq_len` (triton_backend) makes the
same choice at every step of the bucket, within the variants its warm-up compiles.
Block-table entries past a row's sequence length are never read (every backend stops at
`seq_lens`), so a step writes only the columns its longest table needs.

Where no graph is captured (CPU; a backend without `supports_cuda_graphs`; a step on other
KV caches than the captured ones) the same padded inputs run the model eagerly. Steps with
a prefill, and decode steps above the largest bucket, never come here (see `fits`).

The input is host-side data (`DecodeRows`: plain lists) however it was produced;
`decode_rows` makes it from a step message and the worker's persistent batch.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rayserve_paged.core.outputs import StepMessage
from rayserve_paged.models.layers import ROPE_LEN_PER_SEQUENCE
from rayserve_paged.ops.attention import PAD_SLOT, AttentionMetadata

if TYPE_CHECKING:
    from rayserve_paged.worker.input_batch import SeqState

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
BUCKET_STEP = 16  # above SMALL_BUCKETS[-1]


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, 32, then steps of 16, ending at the first size >= max_num_seqs
    (so that every decode batch of up to max_num_seqs sequences has a bucket)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = []
    for size in itertools.chain(SMALL_BUCKETS, itertools.count(SMALL_BUCKETS[-1] + BUCKET_STEP, BUCKET_STEP)):
        sizes.append(size)
        if size >= max_num_seqs:
            return tuple(sizes)
    raise AssertionError("unreachable")


@dataclass(slots=True)
class DecodeRows:
    """One decode-only step on the host: one row per sequence, one new token each."""

    token_ids: list[int]
    positions: list[int]  # of the new token (= tokens already cached)
    seq_lens: list[int]  # cached tokens including the new one
    block_tables: list[list[int]]  # block ids covering positions [0, seq_len)
    slot_mapping: list[int]  # cache slot of the new token
    sampled: list[int]  # rows whose logits the step samples, in sampling order
    rope_lens: list[int] | None = None  # per row, when the model's RoPE needs them (rope_lens_of)

    def __len__(self) -> int:
        return len(self.token_ids)


def rope_lens_of(seq: SeqState, start: int, count: int, rule: str) -> list[int]:
    """RoPE lengths of a row's tokens [start, start + count). The sequence's length at the
    step is the prompt's while prefilling it, else one past the furthest token this worker
    has computed for it (the last sampled token: a decode, or a recompute's whole sequence)."""
    num_prompt_tokens = seq.request.num_prompt_tokens
    if rule == ROPE_LEN_PER_SEQUENCE:
        return [max(num_prompt_tokens, seq.num_computed_max + 1)] * count
    return [max(num_prompt_tokens, p + 1) for p in range(start, start + count)]


def decode_rows(
    msg: StepMessage, rows: list[SeqState], block_size: int, rope_len_rule: str | None = None
) -> DecodeRows | None:
    """The step as DecodeRows when every row computes exactly one token (in row order, as
    ModelRunner.prepare packs them), else None. `rows[i]` is row i's state in the worker's
    persistent batch; a `rope_len_rule` adds each row's RoPE length (see rope_lens_of)."""
    if not rows or len(msg.token_ids) != len(rows):  # every row has at least one token
        return None
    positions = msg.start_positions
    tables = [r.block_table for r in rows]
    unsampled = set(msg.unsampled_seq_ids)
    sampled = [i for i, seq_id in enumerate(msg.seq_ids) if seq_id not in unsampled] if unsampled else list(range(len(rows)))
    return DecodeRows(
        token_ids=msg.token_ids,
        positions=positions,
        seq_lens=[p + 1 for p in positions],
        block_tables=tables,
        slot_mapping=[t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)],
        sampled=sampled,
        rope_lens=[rope_lens_of(r, p, 1, rope_len_rule)[0] for r, p in zip(rows, positions)] if rope_len_rule else None,
    )


class StaticDecode:
    """Decode steps on padded buckets over persistent inputs; CUDA graphs where captured.

    model          forward(input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, H]
    backend        the model's attention backend (begin_step once per eager step; its
                   `supports_cuda_graphs` says whether its forward may be captured), or None
    use_cuda_graphs  False: never capture (the padded path still runs eagerly)
    """

    def __init__(
        self, model: torch.nn.Module, block_size: int, max_num_seqs: int, max_model_len: int,
        device: torch.device | str, backend=None, *, use_cuda_graphs: bool = True,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.buckets = decode_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.use_cuda_graphs = use_cuda_graphs
        rows, device = self.buckets[-1], self.device
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]
        self.slot_mapping = torch.full((rows,), PAD_SLOT, dtype=torch.long, device=device)  # [rows]
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)  # [rows]
        self.block_tables = torch.zeros((rows, self.max_blocks), dtype=torch.int32, device=device)  # [rows, max_blocks]
        needs_rope_lens = getattr(model, "rope_len_rule", None) is not None
        self.rope_lens = torch.ones(rows, dtype=torch.long, device=device) if needs_rope_lens else None  # [rows]
        # the (empty) prefill part of every step's metadata
        self._no_prefill = (
            torch.zeros(1, dtype=torch.int32, device=device),  # query_start_loc
            torch.zeros(0, dtype=torch.int32, device=device),  # context_lens, seq_lens
            torch.zeros((0, self.max_blocks), dtype=torch.int32, device=device),  # block tables
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, output)
        self._graph_caches: list | None = None  # the KV caches the graphs were captured on
        self.runs = {"graph": 0, "eager": 0}  # steps run per path
        self.last_path: str | None = None

    # ------------------------------------------------------------------ the step

    def bucket(self, num_rows: int) -> int:
        """The smallest bucket that holds num_rows rows (ValueError above the largest)."""
        index = bisect.bisect_left(self.buckets, num_rows)
        if num_rows < 1 or index == len(self.buckets):
            raise ValueError(f"{num_rows} decode rows do not fit the buckets {self.buckets}")
        return self.buckets[index]

    def fits(self, rows: DecodeRows | None) -> bool:
        """Whether the step can run here: 1..largest bucket rows, every sequence within
        max_model_len and its block table within the persistent table's width."""
        return (
            rows is not None
            and 1 <= len(rows) <= self.buckets[-1]
            and max(rows.seq_lens) <= self.max_model_len
            and max(map(len, rows.block_tables)) <= self.max_blocks
        )

    def forward(self, rows: DecodeRows, kv_caches: list) -> torch.Tensor:
        """Hidden states [len(rows), hidden] of the real rows: the bucket's graph replayed
        when one was captured on these caches, else the padded batch run eagerly. A graph's
        output is overwritten by its next replay: use it before the next step."""
        num_rows = len(rows)
        size = self.bucket(num_rows)
        self._load(rows, size)
        graph = self.graphs.get(size) if kv_caches is self._graph_caches else None
        if graph is not None:
            graph[0].replay()
            self._count("graph")
            return graph[1][:num_rows]
        metadata = self._metadata(size, rows.seq_lens + [1] * (size - num_rows))
        if self.backend is not None:
            self.backend.begin_step(metadata)  # checks and launch planning, once per step
        hidden = self.model(self.input_ids[:size], self.positions[:size], kv_caches, metadata)  # [size, H]
        self._count("eager")
        return hidden[:num_rows]

    def _count(self, path: str) -> None:
        self.runs[path] += 1
        self.last_path = path

    def _load(self, rows: DecodeRows, size: int) -> None:
        """Copy the rows into the persistent buffers and pad them to `size` rows."""
        pad = size - len(rows)
        width = max(map(len, rows.block_tables))  # columns past it are never read
        for buffer, values, fill in (
            (self.input_ids, rows.token_ids, 0),
            (self.positions, rows.positions, 0),
            (self.slot_mapping, rows.slot_mapping, PAD_SLOT),
        ):
            buffer[:size].copy_(torch.tensor(values + [fill] * pad, dtype=torch.long), non_blocking=True)
        self.seq_lens[:size].copy_(torch.tensor(rows.seq_lens + [1] * pad, dtype=torch.int32), non_blocking=True)
        if self.rope_lens is not None:
            self.rope_lens[:size].copy_(torch.tensor(rows.rope_lens + [1] * pad, dtype=torch.long), non_blocking=True)
        tables = [t + [0] * (width - len(t)) for t in rows.block_tables] + [[0] * width] * pad
        self.block_tables[:size, :width].copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)

    def _metadata(self, size: int, seq_lens_host: list[int] | None) -> AttentionMetadata:
        """A decode-only step of `size` rows on the persistent buffers; planned as if the
        longest sequence were max_model_len long (one plan per bucket)."""
        start, none, no_tables = self._no_prefill
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_prefill_tokens=0,
            num_decode_tokens=size,
            block_size=self.block_size,
            prefill_query_start_loc=start,
            prefill_context_lens=none,
            prefill_seq_lens=none,
            prefill_block_tables=no_tables,
            max_prefill_query_len=0,
            max_prefill_seq_len=0,
            decode_seq_lens=self.seq_lens[:size],
            decode_block_tables=self.block_tables[:size],
            max_decode_seq_len=self.max_model_len,
            prefill_query_lens_host=[],
            prefill_seq_lens_host=[],
            decode_seq_lens_host=seq_lens_host,
            rope_lens=None if self.rope_lens is None else self.rope_lens[:size],
        )

    # ------------------------------------------------------------------ CUDA graphs

    @property
    def can_capture(self) -> bool:
        """CUDA graphs wanted, on a CUDA device, with a backend whose forward is capturable."""
        return (
            self.use_cuda_graphs
            and self.device.type == "cuda"
            and bool(getattr(self.backend, "supports_cuda_graphs", False))
        )

    def _load_padding(self, size: int) -> None:
        """Every row of the bucket a padding row (what a capture runs on)."""
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.slot_mapping[:size].fill_(PAD_SLOT)
        self.seq_lens[:size].fill_(1)
        self.block_tables[:size].zero_()
        if self.rope_lens is not None:
            self.rope_lens[:size].fill_(1)

    @torch.inference_mode()
    def capture(self, kv_caches: list) -> list[int]:
        """Capture one graph per bucket on these KV caches (largest first, one shared memory
        pool); returns the captured buckets ([] where can_capture is False). Each bucket
        first runs once eagerly, so that lazily built state exists before its capture."""
        if not self.can_capture:
            return []
        self.graphs = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self._load_padding(size)
            ids, positions = self.input_ids[:size], self.positions[:size]
            self.model(ids, positions, kv_caches, self._metadata(size, [1] * size))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                # a metadata object of its own: the backend plans it (and allocates its
                # buffers) inside the capture, in the graph's pool
                output = self.model(ids, positions, kv_caches, self._metadata(size, [1] * size))
            self.graphs[size] = (graph, output)
        torch.cuda.synchronize(self.device)
        self._graph_caches = kv_caches
        return sorted(self.graphs)

    @torch.inference_mode()
    def profile_bytes(self, kv_caches: list) -> int:
        """Device bytes the graphs will hold, estimated before any capture (for the KV-cache
        sizing): the peak an eager forward of the largest bucket allocates above what it
        started with (the shared pool's intermediates, the largest graph's) plus the output
        of every bucket (each graph keeps its own). 0 where can_capture is False."""
        if not self.can_capture:
            return 0
        size = self.buckets[-1]
        self._load_padding(size)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        output = self.model(
            self.input_ids[:size], self.positions[:size], kv_caches, self._metadata(size, [1] * size)
        )  # [size, H]
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        row_bytes = output.shape[1] * output.element_size()
        return peak + row_bytes * sum(self.buckets)


def capture_graphs(static: StaticDecode | None, kv_caches: list, rank: int = 0) -> list[int]:
    """static.capture(kv_caches) with its time and memory logged; [] without a static path
    or without a block to read (padding rows read block 0)."""
    if static is None or not static.can_capture or not kv_caches or kv_caches[0][0].shape[0] == 0:
        return []
    before = torch.cuda.memory_allocated(static.device)
    started = time.perf_counter()
    captured = static.capture(kv_caches)
    logger.info(
        "rank %d captured %d decode CUDA graphs (buckets %s) in %.1f s, holding %.1f MiB", rank, len(captured),
        ", ".join(map(str, captured)), time.perf_counter() - started,
        (torch.cuda.memory_allocated(static.device) - before) / 2**20,
    )
    return captured
