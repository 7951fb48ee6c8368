"""The decode-inputs host benchmark on a few steps: its record, the one copy per step, and
the check against a baseline loader (here the current module itself)."""

from __future__ import annotations

import json

from benchmarks import decode_inputs_host
from rayserve_paged.worker import static_decode


def test_decode_inputs_host_records_one_copy_per_step_and_checks_the_baseline(tmp_path):
    argv = ["--steps", "3", "--warmup", "1", "--cases", "blocks_128", "--out", str(tmp_path),
            "--baseline", static_decode.__file__]
    assert decode_inputs_host.main(argv) == 0
    record = json.loads((tmp_path / "decode_inputs_host.json").read_text())
    row = record["results"]["blocks_128"]
    assert record["benchmark"] == "decode-inputs-host" and record["rows"] == 256
    assert row["copies_per_step"] == 1.0 and row["load_us"] > 0 and row["baseline_load_us"] > 0
    # the first step writes all 256 rows; each later step only the rows whose table grew
    assert 256 / 4 < row["rows_written_per_step"] < 256 / 4 + 256 / 16 + 1


def test_decodes_grow_a_table_when_a_new_token_starts_a_block():
    decodes = decode_inputs_host.Decodes(8, seed=0)
    grown = 0
    for _ in range(16):  # 16 tokens each: every row starts exactly one block
        rows, changes = decodes.step()
        grown += len(changes)
        for table, start in changes:
            assert start == len(table) - 1  # the update starts at the table's old length
        for table, position in zip(rows.block_tables, rows.positions):
            assert len(table) == position // decode_inputs_host.BLOCK_SIZE + 1
    assert grown == len(rows) == decode_inputs_host.NUM_ROWS
