"""bench load's answer classes, bench routing-cost and bench priority, on tiny inputs."""

from __future__ import annotations

import json

import httpx

from benchmarks import load, priority, routing_cost
from rayserve_paged import cli


def test_load_tells_our_503_from_serves_and_a_whole_answer_from_a_cut_one():
    assert cli.BENCHMARKS["load"] == "benchmarks.load"
    ours = httpx.Response(503, headers={"retry-after": "3"},
                          json={"error": {"message": "m", "type": "server_error", "param": None, "code": "overloaded"}})  # fmt: skip
    serves = httpx.Response(503, text="Request dropped due to backpressure (num_queued_requests=32)")
    no_retry_after = httpx.Response(503, json={"error": {"message": "m", "type": "server_error", "code": "x"}})
    whole = httpx.Response(200, json={"choices": [{"finish_reason": "length"}]})
    cut = httpx.Response(200, json={"choices": [{"finish_reason": None}]})
    assert [load.classify(r) for r in (ours, serves, no_retry_after, whole, cut, httpx.Response(408))] == [
        "shed", "serve-503", "serve-503", "ok", "other-200", "other-408",
    ]  # fmt: skip


def test_routing_cost_and_priority_write_their_records(tmp_path):
    assert routing_cost.main(["--replicas", "2", "--keys", "100", "--decisions", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "routing_cost.json").read_text())["rows"]
    assert [(r["replicas"], r["keys"]) for r in rows] == [(2, 100)]
    args = ["--flood", "4", "--urgent", "2", "--every", "2", "--rounds", "1", "--kv-blocks", "64", "--out", str(tmp_path)]
    assert priority.main(args) == 0
    runs = json.loads((tmp_path / "priority.json").read_text())["runs"]
    assert [r["policy"] for r in runs] == ["fcfs", "priority"]
    assert all(r["urgent_ttft_p50_ms"] > 0 for r in runs)
