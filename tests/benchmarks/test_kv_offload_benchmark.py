"""The kv-offload benchmark on its quick run: what it records, never its speed."""

from __future__ import annotations

import json

from rayserve_paged import cli


def test_the_quick_run_restores_instead_of_recomputing_with_the_same_tokens(tmp_path):
    assert cli.BENCHMARKS["kv-offload"] == "benchmarks.kv_offload"
    assert cli.main(["bench", "kv-offload", "--out", str(tmp_path), "--quick", "--threads", "1"]) == 0
    record = json.loads((tmp_path / "kv_offload.json").read_text())
    results = record["results"]
    assert results["outputs_equal"] is True
    off, on = results["tier_off"], results["tier_2"]
    assert record["device_blocks"] < record["working_set_blocks"]
    assert off["host_hits"] == off["restored_blocks"] == 0
    assert on["restored_blocks"] > 0 and on["host_hits"] == 16 * on["restored_blocks"]
    assert on["prefill_tokens"] + on["host_hits"] + on["device_hits"] == off["prefill_tokens"] + off["device_hits"]
    assert "machine" in record
