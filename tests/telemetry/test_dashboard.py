"""deploy/grafana-dashboard.json: valid JSON, and every query names only series that the
project exports (the names come from a real rendering of a replica's metrics, not a list)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rayserve_paged.deployments.routing import RoutingStats
from rayserve_paged.telemetry import ReplicaTelemetry, TelemetryConfig

from .conftest import start_engine
from .test_prometheus import _full_snapshot

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"

# PromQL functions, aggregations and keywords the dashboard uses (anything else is a metric)
PROMQL_WORDS = frozenset(
    "sum count max min avg rate irate increase histogram_quantile topk bottomk and or unless "
    "offset bool label_values max_over_time min_over_time avg_over_time".split()
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (or a Grafana label_values() query)."""
    e = re.sub(r'"[^"]*"', '""', expr)  # strings (label values, regexes)
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)  # label lists
    e = re.sub(r"\b(group_left|group_right)\b", "", e)  # without a label list
    e = re.sub(r"label_values\(\s*([^,]+),[^)]*\)", r"\1", e)  # label_values(metric, label)
    return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e) if w not in PROMQL_WORDS}


def queries(dashboard: dict) -> list[str]:
    out = []
    for panel in dashboard["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


@pytest.fixture(scope="module")
def exported(swap_run, tiny_opt) -> set[str]:
    """Every series name a replica exports: a run that preempted, with GPU ranks reported."""
    swap_run.telemetry.update_gpu([_full_snapshot(rank=0, gpu_index=3)])
    try:
        text = swap_run.telemetry.metrics_text()
    finally:
        swap_run.telemetry.update_gpu([])
    speculating = start_engine(tiny_opt, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    spec_telemetry = ReplicaTelemetry(speculating, TelemetryConfig(replica="spec"))  # and what speculation adds
    try:
        spec_text = spec_telemetry.metrics_text()
    finally:
        spec_telemetry.shutdown()
    routing = RoutingStats()  # and what a fleet ingress adds (routing: prefix)
    routing.record_decision("prefix", "r1")
    routing.record_step(0.001)
    texts = (text, spec_text, routing.metrics_text("i1"))
    return {s.name for t in texts for f in text_string_to_metric_families(t) for s in f.samples}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_metric_names_of_promql():
    expr = 'histogram_quantile(0.99, sum by (le, replica) (rate(a_bucket{replica=~"$replica"}[$__rate_interval])))'
    assert metric_names(expr) == {"a_bucket"}
    assert metric_names("sum(rate(x_total[5m])) / on (replica) group_left y") == {"x_total", "y"}
    assert metric_names("label_values(m, replica)") == {"m"}


def test_every_query_names_an_exported_metric(dashboard, exported):
    found = queries(dashboard)
    assert len(found) >= 20
    for expr in found:
        named = metric_names(expr)
        assert named, expr
        assert named <= exported, (expr, named - exported)


def test_the_dashboard_covers_the_fleet(dashboard):
    used = set().union(*(metric_names(q) for q in queries(dashboard)))
    for needed in (
        "rayserve_paged_kv_cache_usage",  # KV usage per replica (and replicas over time)
        "rayserve_paged_kv_cache_fragmentation",
        "rayserve_paged_scheduler_preemptions_total",
        "rayserve_paged_kv_cache_swapped_blocks_total",
        "rayserve_paged_scheduler_requests",  # waiting / running / swapped
        "rayserve_paged_request_time_to_first_token_seconds_bucket",
        "rayserve_paged_request_time_per_output_token_seconds_bucket",
        "rayserve_paged_request_e2e_latency_seconds_bucket",
        "rayserve_paged_tokens_total",
        "rayserve_paged_prefix_cache_hits_total",
        "rayserve_paged_routing_decisions_total",  # fleet routing by reason
        "hw_gpu_memory_usage_bytes",  # per device and rank
    ):
        assert needed in used, needed
    titles = {p["title"] for p in dashboard["panels"]}
    assert "Replicas reporting" in titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
