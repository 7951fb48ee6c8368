"""Static-shape decode: padded buckets, length classes, one host mirror, CUDA graphs.

A decode-only step of n sequences runs as a batch of `bucket(n)` rows, the smallest of
`decode_buckets(max_num_seqs)` that holds n, planned for `length_class(longest)`, the
smallest of `length_classes(max_model_len)` that holds the step's longest sequence. Its
inputs live in one persistent device buffer, so every step of one (bucket, length class)
has the same shapes and the same addresses, and one CUDA graph per (bucket, length class),
captured at start-up, replays the whole model forward. A model whose RoPE depends on a
length (dynamic NTK, LongRoPE) also gets each row's RoPE length (a column of the buffer).

    rows      0 .......... n-1 | n .......... bucket-1
              the step's decodes | padding: token 0 at position 0, slot PAD_SLOT (writes
                                 | nothing), sequence length 1 over block 0 (reads one
                                 | cached slot: finite, never NaN), block-table entry 0 = 0

The buffer, in int32 words, R = the largest bucket, W = ceil(length class / block_size);
the int64 columns first, every section starting on a 16-byte boundary (4 words: `_align`),
so that each column is a naturally aligned view at every R (1 and 2 included) and every
pointer a kernel gets is 16-byte aligned (Triton specializes on that: an unaligned one would
compile another variant after warm-up):

    [ token ids R x int64 | positions R x int64 | slots R x int64 | RoPE lengths R x int64 |
      seq_lens R (+ pad) | tables R x W ]

The block-table section is read as [R, W] of the step's class (row stride W), so a class's
rows are contiguous and a step's inputs are one prefix of the buffer. A pinned host mirror
of the same layout is kept across steps: a step rewrites the small columns, and in the
tables only the entries that changed since the row last held them (a row holds one
sequence's table until another sequence takes the row; block-table updates lower what the
row holds to their start), then copies the prefix its bucket reads to the device: one
host-to-device copy per step. A class change rewrites every row (the row stride changes).
Block-table entries past a row's sequence length are never read (every backend stops at
`seq_lens`).

The attention plan is static per (bucket, length class): `max_decode_seq_len` is the class
length, so a backend that chooses its decode variant and partition count from it
(triton_backend) makes the same choice at every step of the pair, within the variants its
warm-up compiles, and the grid is sized for at most LENGTH_CLASS_GROWTH times the step's
real longest sequence (above the smallest class), not for max_model_len.

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
from rayserve_paged.ops.cache_ops import slot_of

if TYPE_CHECKING:
    from rayserve_paged.worker.input_batch import SeqState

logger = logging.getLogger(__name__)

PAD = object()  # what a padding row of the host mirror holds instead of a block table

SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
BUCKET_STEP = 16  # above SMALL_BUCKETS[-1]
LENGTH_CLASS_BASE = 1024  # tokens: the smallest length class
LENGTH_CLASS_GROWTH = 4  # each class this many times the one below (the last is max_model_len)


ALIGN_WORDS = 4  # int32 words in 16 bytes: where every section of the input buffer starts


def _align(words: int) -> int:
    return -(-words // ALIGN_WORDS) * ALIGN_WORDS


def column_offsets(rows: int) -> tuple[int, ...]:
    """Where the input buffer's sections start, in int32 words, for `rows` rows: token ids,
    positions, slots, RoPE lengths (int64, 2 words a row), seq_lens (int32), then the block
    tables; each 16-byte aligned.

    >>> column_offsets(1), column_offsets(2), column_offsets(4)
    ((0, 4, 8, 12, 16, 20), (0, 4, 8, 12, 16, 20), (0, 8, 16, 24, 32, 36))
    """
    offsets, at = [], 0
    for words_per_row in (2, 2, 2, 2, 1):
        offsets.append(at)
        at = _align(at + words_per_row * rows)
    return (*offsets, at)


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


def verification_rows(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int,
                       disable_by_batch_size: int) -> int:
    """The most one-token rows a decode step can have once its draft verifications are
    expanded (expanded_draft_rows): drafts come only while fewer than disable_by_batch_size
    sequences run, each adds at most num_speculative_tokens rows, and every row is a token
    of the step's budget.

    >>> verification_rows(256, 8192, 4, 4), verification_rows(4, 12, 4, 4), verification_rows(2, 8192, 4, 4)
    (256, 12, 10)
    """
    drafting_seqs = min(max_num_seqs, disable_by_batch_size - 1)
    return max(max_num_seqs, min(max_num_batched_tokens, drafting_seqs * (1 + num_speculative_tokens)))


def length_classes(max_model_len: int, base: int = LENGTH_CLASS_BASE) -> tuple[int, ...]:
    """base, base x 4, base x 16, ... below max_model_len, then max_model_len itself:
    the lengths a decode step is planned (and its graphs captured) for.

    >>> length_classes(8192), length_classes(131072), length_classes(600)
    ((1024, 4096, 8192), (1024, 4096, 16384, 65536, 131072), (600,))
    """
    if max_model_len < 1 or base < 1:
        raise ValueError(f"max_model_len and the class base must be >= 1, got {max_model_len} and {base}")
    classes = []
    length = base
    while length < max_model_len:
        classes.append(length)
        length *= LENGTH_CLASS_GROWTH
    return (*classes, max_model_len)


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
    msg: StepMessage, rows: list[SeqState], block_size: int, rope_len_rule: str | None = None, *,
    expand_drafts: bool = False,
) -> DecodeRows | None:
    """The step as DecodeRows when every row computes exactly one token (in row order, as
    ModelRunner.prepare packs them), else None. `rows[i]` is row i's state in the worker's
    persistent batch; a `rope_len_rule` adds each row's RoPE length (see rope_lens_of).
    With `expand_drafts`, a row verifying k drafts counts as 1 + k one-token rows
    (expanded_draft_rows); any other row of more than one token still gives None."""
    if not rows:
        return None
    if len(msg.token_ids) != len(rows):  # every row has at least one token
        return expanded_draft_rows(msg, rows, block_size, rope_len_rule) if expand_drafts and msg.draft_seq_ids else None
    positions = msg.start_positions
    tables = [r.block_table for r in rows]
    unsampled = set(msg.unsampled_seq_ids)
    sampled = [i for i, seq_id in enumerate(msg.seq_ids) if seq_id not in unsampled] if unsampled else list(range(len(rows)))
    return DecodeRows(
        token_ids=msg.token_ids,
        positions=positions,
        seq_lens=[p + 1 for p in positions],
        block_tables=tables,
        slot_mapping=[slot_of(t, p, block_size) for t, p in zip(tables, positions)],
        sampled=sampled,
        rope_lens=[rope_lens_of(r, p, 1, rope_len_rule)[0] for r, p in zip(rows, positions)] if rope_len_rule else None,
    )


def expanded_draft_rows(
    msg: StepMessage, rows: list[SeqState], block_size: int, rope_len_rule: str | None = None
) -> DecodeRows | None:
    """A step of decodes and draft verifications as one-token rows; None when some row is
    neither (a prefill chunk). A row of 1 + k query tokens (its last token, then k drafts)
    at positions c .. c + k becomes k + 1 rows over the sequence's one block table:

        query row     t      d1      d2  ...  dk
        decode row    j = 0  1       2        k
        position      c      c + 1   c + 2    c + k      slot: that position's
        seq_len       c + 1  c + 2   c + 3    c + k + 1  row j attends to positions <= c + j

    Causal by construction because every backend, and the compiled decoder layer, writes
    all of a layer's new keys and values before any row of that layer attends
    (ops/paged_attention.py), so row j reads rows < j of the same step. Every expanded row
    is sampled: the 1 + k logits rows the verification reads, in row order as the eager
    path's `logits_indices` puts them."""
    drafts = dict(zip(msg.draft_seq_ids, msg.num_draft_tokens))
    unsampled = set(msg.unsampled_seq_ids)
    token_ids, positions, tables, slots, sampled = [], [], [], [], []
    rope_lens: list[int] | None = [] if rope_len_rule else None
    offset = 0
    for seq, seq_id, start, count in zip(rows, msg.seq_ids, msg.start_positions, msg.num_query_tokens):
        if count != 1 + drafts.get(seq_id, 0):
            return None
        table = seq.block_table
        if seq_id not in unsampled:
            sampled.extend(range(len(token_ids), len(token_ids) + count))
        token_ids.extend(msg.token_ids[offset : offset + count])
        positions.extend(range(start, start + count))
        tables.extend([table] * count)
        slots.extend(slot_of(table, p, block_size) for p in range(start, start + count))
        if rope_lens is not None:
            rope_lens.extend(rope_lens_of(seq, start, count, rope_len_rule))
        offset += count
    return DecodeRows(token_ids, positions, [p + 1 for p in positions], tables, slots, sampled, rope_lens)


class StaticDecode:
    """Decode steps on padded buckets and length classes over one persistent input buffer
    and its host mirror; CUDA graphs where captured.

    model          forward(input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, H]
    backend        the model's attention backend (begin_step once per eager step; its
                   `supports_cuda_graphs` says whether its forward may be captured), or None
    use_cuda_graphs  False: never capture (the padded path still runs eagerly)
    capture_error_mode  torch.cuda.graph's: "thread_local" where collectives (NCCL) run
                   inside the capture (TP > 1), "global" otherwise
    length_class_base  the smallest length class (length_classes)
    max_num_rows   rows the buckets hold (at least max_num_seqs): more where a step's draft
                   verifications expand into one-token rows (verification_rows)

    On the CPU a step whose rows verify drafts runs here too, each such row expanded into
    one-token rows (expanded_draft_rows; `expands_drafts`): such a step then takes the
    compiled decoder layer where the model qualifies (one call per layer instead of ~60
    torch calls), and the compiled paged-decode attention otherwise (docs/benchmarks/
    27-speculative.md, 27b). On CUDA verification rows stay on the eager path.
    """

    def __init__(
        self, model: torch.nn.Module, block_size: int, max_num_seqs: int, max_model_len: int,
        device: torch.device | str, backend=None, *, use_cuda_graphs: bool = True,
        capture_error_mode: str = "global", length_class_base: int = LENGTH_CLASS_BASE,
        max_num_rows: int | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # torch.cuda calls take cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.expands_drafts = self.device.type == "cpu"
        self.buckets = decode_buckets(max(max_num_seqs, max_num_rows or 0))
        self.max_model_len = max_model_len
        self.length_classes = length_classes(max_model_len, length_class_base)
        self.max_blocks = -(-max_model_len // block_size)
        self.use_cuda_graphs = use_cuda_graphs
        self.capture_error_mode = capture_error_mode
        rows = self.rows = self.buckets[-1]
        self._column_at = column_offsets(rows)  # int32 word where each column starts
        self._tables_at = self._column_at[-1]  # int32 words before the block-table section
        words = self._tables_at + rows * self.max_blocks
        pin = self.device.type == "cuda"
        self._words = torch.zeros(words, dtype=torch.int32, device=self.device)  # the layout in the module docstring
        self._host = torch.zeros(words, dtype=torch.int32, pin_memory=pin)  # its mirror
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens, rope_lens = self._columns(self._words)
        self._host_columns = self._columns(self._host)  # [rows] each
        # each row's RoPE length, only for a model whose RoPE depends on one (rope_lens_of)
        self.rope_lens = rope_lens if getattr(model, "rope_len_rule", None) is not None else None
        self._host_class = 0  # the length class the mirror's tables are laid out for (0: none yet)
        self._row_table: list = [None] * rows  # the table (list) each mirror row holds, PAD, or None
        self._row_len = [0] * rows  # entries of that table the mirror row holds
        self._table_row: dict[int, int] = {}  # id(table) -> its mirror row (the lists are held above)
        self._copied = None  # CUDA event after the last host-to-device copy: the mirror is free again
        self.block_tables = self._tables(self._words, self.length_classes[-1])  # the last step's [rows, W]
        # the (empty) prefill part of every step's metadata
        self._no_prefill = (
            torch.zeros(1, dtype=torch.int32, device=device),  # query_start_loc
            torch.zeros(0, dtype=torch.int32, device=device),  # context_lens, seq_lens
            torch.zeros((0, self.max_blocks), dtype=torch.int32, device=device),  # block tables
        )
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (bucket, class) -> ...
        self._graph_caches: list | None = None  # the KV caches the graphs were captured on
        self.runs = {"graph": 0, "eager": 0}  # steps run per path
        self.last_path: str | None = None
        self.last_length_class: int | None = None
        # host work, counted: host-to-device copies, mirror rows and table entries rewritten
        self.num_copies = 0
        self.num_rows_written = 0
        self.num_entries_written = 0

    def _columns(self, words: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(token ids, positions, slots) as int64 [rows], seq_lens as int32 [rows], RoPE
        lengths as int64 [rows]."""
        r, at = self.rows, self._column_at
        ids, positions, slots, rope_lens = (words[at[i] : at[i] + 2 * r].view(torch.int64) for i in range(4))
        return ids, positions, slots, words[at[4] : at[4] + r], rope_lens

    def _tables(self, words: torch.Tensor, length: int) -> torch.Tensor:
        """The block-table section read as [rows, ceil(length / block_size)]."""
        width = -(-length // self.block_size)
        return words[self._tables_at : self._tables_at + self.rows * width].view(self.rows, width)

    # ------------------------------------------------------------------ the step

    def bucket(self, num_rows: int) -> int:
        """The smallest bucket that holds num_rows rows (ValueError above the largest)."""
        index = bisect.bisect_left(self.buckets, num_rows)
        if num_rows < 1 or index == len(self.buckets):
            raise ValueError(f"{num_rows} decode rows do not fit the buckets {self.buckets}")
        return self.buckets[index]

    def length_class(self, longest: int) -> int:
        """The smallest length class that holds a sequence of `longest` tokens (ValueError
        above max_model_len)."""
        index = bisect.bisect_left(self.length_classes, longest)
        if longest < 1 or index == len(self.length_classes):
            raise ValueError(f"a {longest}-token sequence does not fit the length classes {self.length_classes}")
        return self.length_classes[index]

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
        """Hidden states [len(rows), hidden] of the real rows: the (bucket, length class)
        graph replayed when one was captured on these caches, else the padded batch run
        eagerly. A graph's output is overwritten by its next replay: use it before the next
        step."""
        num_rows = len(rows)
        size = self.bucket(num_rows)
        length = self.last_length_class = self.length_class(max(rows.seq_lens))
        self._load(rows, size, length)
        graph = self.graphs.get((size, length)) if kv_caches is self._graph_caches else None
        if graph is not None:
            graph[0].replay()
            self._count("graph")
            return graph[1][:num_rows]
        metadata = self._metadata(size, length, rows.seq_lens + [1] * (size - num_rows))
        if self.backend is not None:
            self.backend.begin_step(metadata)  # checks and launch planning, once per step
        hidden = self.model(self.input_ids[:size], self.positions[:size], kv_caches, metadata)  # [size, H]
        self._count("eager")
        return hidden[:num_rows]

    def _count(self, path: str) -> None:
        self.runs[path] += 1
        self.last_path = path

    def note_table_changes(self, changes) -> None:
        """Block tables changed from these indices on ((table list, first changed index)
        pairs; the worker's batch applied them): a mirror row holding such a table rewrites
        it from there the next time it is loaded."""
        for table, start in changes:
            row = self._table_row.get(id(table))
            if row is not None and self._row_table[row] is table:
                self._row_len[row] = min(self._row_len[row], start)

    def _load(self, rows: DecodeRows, size: int, length: int) -> None:
        """Bring the host mirror up to this step (small columns in full, block tables where
        they changed; padding up to `size` rows) and copy the prefix this (bucket, class)
        reads to the device: one host-to-device copy."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the mirror
        num_rows, pad = len(rows), size - len(rows)
        host_ids, host_positions, host_slots, host_seq_lens, host_rope_lens = self._host_columns
        host_ids[:size] = torch.tensor(rows.token_ids + [0] * pad, dtype=torch.long)
        host_positions[:size] = torch.tensor(rows.positions + [0] * pad, dtype=torch.long)
        host_slots[:size] = torch.tensor(rows.slot_mapping + [PAD_SLOT] * pad, dtype=torch.long)
        host_seq_lens[:size] = torch.tensor(rows.seq_lens + [1] * pad, dtype=torch.int32)
        if self.rope_lens is not None:
            host_rope_lens[:size] = torch.tensor(rows.rope_lens + [1] * pad, dtype=torch.long)
        if length != self._host_class:  # another row stride: every row is rewritten
            self._host_class = length
            self._row_table = [None] * self.rows
            self._table_row.clear()
        host_tables = self._tables(self._host, length)  # [rows, width]
        width = host_tables.shape[1]
        for row, table in enumerate(rows.block_tables):
            start = self._take_row(row, table)
            end = min(len(table), width)  # entries past the class's length are never read
            if start < end:
                host_tables[row, start:end] = torch.tensor(table[start:end], dtype=torch.int32)
                self.num_rows_written += 1
                self.num_entries_written += end - start
            self._row_len[row] = end
        for row in range(num_rows, size):
            if self._take_row(row, PAD) == 0:
                host_tables[row, 0] = 0
                self.num_rows_written += 1
                self.num_entries_written += 1
                self._row_len[row] = 1
        used = self._tables_at + size * width
        self._words[:used].copy_(self._host[:used], non_blocking=True)
        self.num_copies += 1
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()  # one event, re-recorded each step
            self._copied.record(torch.cuda.current_stream(self.device))
        self.block_tables = self._tables(self._words, length)

    def _take_row(self, row: int, table) -> int:
        """Mirror row `row` now holds `table` (a list, or PAD); the first entry to write."""
        held = self._row_table[row]
        if held is table:
            return self._row_len[row]
        if held is not None and held is not PAD:
            del self._table_row[id(held)]
        if table is not PAD:
            other = self._table_row.get(id(table))
            if other is not None:  # the table moved rows: its old row holds nothing now
                self._row_table[other] = None
            self._table_row[id(table)] = row
        self._row_table[row] = table
        self._row_len[row] = 0
        return 0

    def _metadata(self, size: int, length: int, seq_lens_host: list[int] | None) -> AttentionMetadata:
        """A decode-only step of `size` rows on the persistent buffers, planned as if the
        longest sequence were `length` (its class) long: one plan per (bucket, class)."""
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
            decode_block_tables=self._tables(self._words, length)[:size],
            max_decode_seq_len=length,
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

    def _load_padding(self, size: int, length: int) -> None:
        """Every row of the bucket a padding row, on the device (what a capture runs on;
        the next step's copy brings the mirror's rows back)."""
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.slot_mapping[:size].fill_(PAD_SLOT)
        self.seq_lens[:size].fill_(1)
        self._tables(self._words, length)[:size].zero_()
        if self.rope_lens is not None:
            self.rope_lens[:size].fill_(1)

    @torch.inference_mode()
    def capture(self, kv_caches: list) -> list[int]:
        """Capture one graph per (bucket, length class) on these KV caches (longest class and
        largest bucket first, one shared memory pool); returns the captured buckets ([] where
        can_capture is False). Each pair first runs once eagerly, so that lazily built state
        exists before its capture."""
        if not self.can_capture:
            return []
        self.graphs = {}
        pool = torch.cuda.graph_pool_handle()
        for length in reversed(self.length_classes):
            for size in reversed(self.buckets):
                self._load_padding(size, length)
                ids, positions = self.input_ids[:size], self.positions[:size]
                self.model(ids, positions, kv_caches, self._metadata(size, length, [1] * size))
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_error_mode):
                    # a metadata object of its own: the backend plans it (and allocates its
                    # buffers) inside the capture, in the graph's pool
                    output = self.model(ids, positions, kv_caches, self._metadata(size, length, [1] * size))
                self.graphs[(size, length)] = (graph, output)
        torch.cuda.synchronize(self.device)
        self._graph_caches = kv_caches
        return sorted({size for size, _ in self.graphs})

    @torch.inference_mode()
    def profile_bytes(self, kv_caches: list) -> int:
        """Device bytes the graphs will hold, estimated before any capture (for the KV-cache
        sizing): the peak an eager forward of the largest bucket at the longest class
        allocates above what it started with (the shared pool's intermediates, the largest
        graph's) plus the output of every (bucket, class) graph (each keeps its own). 0 where
        can_capture is False."""
        if not self.can_capture:
            return 0
        size, length = self.buckets[-1], self.length_classes[-1]
        self._load_padding(size, length)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        output = self.model(
            self.input_ids[:size], self.positions[:size], kv_caches, self._metadata(size, length, [1] * size)
        )  # [size, H]
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        row_bytes = output.shape[1] * output.element_size()
        return peak + row_bytes * sum(self.buckets) * len(self.length_classes)


def capture_graphs(static: StaticDecode | None, kv_caches: list, rank: int = 0) -> list[int]:
    """static.capture(kv_caches) with its time and memory logged; [] without a static path
    or without a block to read (padding rows read block 0)."""
    if static is None or not static.can_capture or not kv_caches or kv_caches[0][0].shape[0] == 0:
        return []
    before = torch.cuda.memory_allocated(static.device)
    started = time.perf_counter()
    captured = static.capture(kv_caches)
    logger.info(
        "rank %d captured %d decode CUDA graphs (buckets %s x length classes %s) in %.1f s, holding %.1f MiB", rank,
        len(static.graphs), ", ".join(map(str, captured)), ", ".join(map(str, static.length_classes)),
        time.perf_counter() - started,
        (torch.cuda.memory_allocated(static.device) - before) / 2**20,
    )
    return captured
