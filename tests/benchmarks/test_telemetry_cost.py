"""`rayserve-paged bench telemetry --quick` writes its figures (never asserts speed)."""

from __future__ import annotations

import json

from rayserve_paged.cli import main


def test_telemetry_benchmark_writes_json(tmp_path):
    assert main(["bench", "telemetry", "--out", str(tmp_path), "--quick"]) == 0
    result = json.loads((tmp_path / "telemetry.json").read_text())
    assert len(result["off_output_tokens_per_s"]) == len(result["on_output_tokens_per_s"]) == 1
    assert all(v > 0 for v in result["off_output_tokens_per_s"] + result["on_output_tokens_per_s"])
    assert isinstance(result["target_met"], bool) and -1 < result["cost_fraction"] < 1
