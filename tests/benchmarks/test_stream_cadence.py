"""The front-end cadence benchmark, one quick run on the ceiling model: every request's
tokens arrive, in as many events as the interval allows. Never its speed."""

from __future__ import annotations

import json

from benchmarks import stream_cadence


def test_a_quick_run_reads_every_token_and_coalesces_with_an_interval(tmp_path):
    argv = ["--interval-ms", "0", "--interval-ms", "60000", "--quick", "--out", str(tmp_path)]
    assert stream_cadence.main(argv) == 0
    record = json.loads((tmp_path / "stream_cadence.json").read_text())
    assert record["benchmark"] == "stream-cadence" and record["machine"]["cpu_count"] >= 1
    free, held = record["results"]["runs"]
    assert [free["interval_ms"], held["interval_ms"]] == [0.0, 60000.0]
    assert free["output_tokens"] == held["output_tokens"] == 4 * 8
    # an interval no run outlasts: the first token, then the rest with the end (one event
    # when the engine thread ran ahead of the reader to the end before its first read)
    assert 4 <= held["events"] <= 4 * 2
    assert 4 <= free["events"] <= 4 * 8  # at most one event per token, at least one per request
    assert held["gap_ms"]["median"] is not None and held["e2e_ms"]["p99"] is not None
