"""GET /metrics: the engine's metrics in Prometheus text, parsed with prometheus_client."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MODEL

pytestmark = pytest.mark.anyio


async def test_metrics_route_serves_prometheus_text(http, engine):
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200
    r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    usage = families["rayserve_paged_kv_cache_usage"]
    assert {s.labels.get("replica") for s in usage.samples} == {"test-replica"}
    assert all(0.0 <= s.value <= 1.0 for s in usage.samples)
    usage = engine.block_manager.usage()
    blocks = families["rayserve_paged_kv_cache_blocks"].samples
    gpu = {s.labels["state"]: s.value for s in blocks if s.labels["pool"] == "gpu"}
    cpu = {s.labels["state"]: s.value for s in blocks if s.labels["pool"] == "cpu"}
    assert sum(gpu.values()) == usage.gpu_total and gpu["used"] == 0  # the request has finished
    assert sum(cpu.values()) == usage.cpu_total
