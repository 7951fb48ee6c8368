"""Host time of loading one static-shape decode step's inputs (worker/static_decode.py).

NUM_ROWS running decodes at steady state: every row's position advances by one each step,
and a row gains a block (a block-table update from its old length) when its new token
starts one, so about 1 row in 16 changes its table per step at block size 16. Each step
times `StaticDecode.forward` with a model that computes nothing (it returns its input), so
the figure is the inputs' host work: the token, position, slot and length columns, the
block tables, the padding, the copies into the persistent buffers and the step's metadata.
CPU tensors, one torch thread, Python's garbage collector enabled; median of the timed
steps after warm-up.

Cases: `blocks_128` and `blocks_512`: tables of about 128 / 512 blocks (2k / 8k tokens).

--baseline FILE times, interleaved step by step with the current code, a static_decode.py
from FILE (one with the same StaticDecode(model, block_size, max_num_seqs, max_model_len,
device) and forward(rows, kv_caches)), e.g. the file before the host mirror:

    git show b1fc6b2:rayserve_paged/worker/static_decode.py > /tmp/static_decode_before.py
    python -m benchmarks.decode_inputs_host --baseline /tmp/static_decode_before.py
"""

from __future__ import annotations

import random
import sys
import time

import torch

from benchmarks.metrics import median_us
from benchmarks.options import host_time_parser, parse_host_time_args, time_cases
from benchmarks.records import load_module, report_rows
from rayserve_paged.ops.cache_ops import slot_of
from rayserve_paged.worker.static_decode import DecodeRows, StaticDecode

NUM_ROWS = 256
BLOCK_SIZE = 16
CASES = {"blocks_128": 128, "blocks_512": 512}


def no_model(input_ids, positions, kv_caches, metadata):
    return input_ids


class Decodes:
    """NUM_ROWS sequences decoding one token per step, their tables grown as they need."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        rng = random.Random(seed)
        self.positions = [(num_blocks - 1) * BLOCK_SIZE + rng.randrange(BLOCK_SIZE) for _ in range(NUM_ROWS)]
        self.tables = [list(range(r * 2 * num_blocks, r * 2 * num_blocks + p // BLOCK_SIZE + 1))
                       for r, p in enumerate(self.positions)]
        self.tokens = [rng.randrange(1000) for _ in range(NUM_ROWS)]

    def step(self) -> tuple[DecodeRows, list[tuple[list[int], int]]]:
        """The next step's rows, and the (table, start) changes the step message carried."""
        changes = []
        for row, position in enumerate(self.positions):
            position += 1
            self.positions[row] = position
            table = self.tables[row]
            if position // BLOCK_SIZE == len(table):
                changes.append((table, len(table)))
                table.append(table[-1] + 1)
        rows = DecodeRows(
            token_ids=list(self.tokens), positions=list(self.positions), seq_lens=[p + 1 for p in self.positions],
            block_tables=self.tables,
            slot_mapping=[slot_of(t, p, BLOCK_SIZE) for t, p in zip(self.tables, self.positions)],
            sampled=list(range(NUM_ROWS)),
        )
        return rows, changes


def check_same_inputs(static, before, rows: DecodeRows) -> None:
    """Both loaders put the same columns and the same table entries in their buffers."""
    n = len(rows)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        if not torch.equal(getattr(static, name)[:n], getattr(before, name)[:n]):
            raise AssertionError(f"the baseline loaded another {name}")
    for row, table in enumerate(rows.block_tables):
        if static.block_tables[row, : len(table)].tolist() != table or before.block_tables[row, : len(table)].tolist() != table:
            raise AssertionError(f"row {row}: the loaders' block tables differ from the step's")


def time_case(num_blocks: int, steps: int, warmup: int, seed: int, baseline) -> dict:
    max_model_len = (num_blocks + 4) * BLOCK_SIZE + steps + warmup  # every step fits
    decodes = Decodes(num_blocks, seed)
    static = StaticDecode(no_model, BLOCK_SIZE, NUM_ROWS, max_model_len, "cpu")
    before = None
    if baseline is not None:
        before = baseline.StaticDecode(no_model, BLOCK_SIZE, NUM_ROWS, max_model_len, "cpu")
    now_ns, before_ns = [], []
    for step in range(warmup + steps):
        rows, changes = decodes.step()
        start = time.perf_counter_ns()
        static.note_table_changes(changes)
        static.forward(rows, None)
        done = time.perf_counter_ns()
        if before is not None:
            b_rows = baseline.DecodeRows(rows.token_ids, rows.positions, rows.seq_lens, rows.block_tables,
                                         rows.slot_mapping, rows.sampled)
            b_start = time.perf_counter_ns()
            before.forward(b_rows, None)
            b_done = time.perf_counter_ns()
            if step % 50 == 0:
                check_same_inputs(static, before, rows)
        if step >= warmup:
            now_ns.append(done - start)
            if before is not None:
                before_ns.append(b_done - b_start)
    row = {
        "load_us": median_us(now_ns), "copies_per_step": static.num_copies / (warmup + steps),
        "rows_written_per_step": round(static.num_rows_written / (warmup + steps), 2),
        "length_class": static.last_length_class,
    }
    if before is not None:
        row["baseline_load_us"] = median_us(before_ns)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = host_time_parser(
        "python -m benchmarks.decode_inputs_host", __doc__.splitlines()[0], CASES, out_name="decode_inputs_host.json",
        baseline_help="a static_decode.py timed alongside",
    )
    args = parse_host_time_args(parser, argv)
    baseline = load_module(args.baseline, "static_decode_baseline") if args.baseline else None

    def timed(case: str) -> dict:
        return time_case(CASES[case], args.steps, args.warmup, args.seed, baseline)

    results = time_cases(parser, args, CASES, timed)
    title = f"static decode input loading, {NUM_ROWS} rows, block {BLOCK_SIZE} (median us per step)"
    report_rows(title, results, 11, args.out, "decode-inputs-host", rows=NUM_ROWS, block_size=BLOCK_SIZE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
