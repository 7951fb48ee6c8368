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
    # a CPU run: the KV cache is the "device" pool, nothing is labelled gpu
    assert {s.labels["pool"] for s in usage.samples} == {"device", "cpu"}
    assert 'pool="gpu"' not in r.text
    usage = engine.block_manager.usage()
    blocks = families["rayserve_paged_kv_cache_blocks"].samples
    gpu = {s.labels["state"]: s.value for s in blocks if s.labels["pool"] == "device"}
    cpu = {s.labels["state"]: s.value for s in blocks if s.labels["pool"] == "cpu"}
    assert sum(gpu.values()) == usage.gpu_total and gpu["used"] == 0  # the request has finished
    assert sum(cpu.values()) == usage.cpu_total


async def test_the_fleet_view_is_listed_once_per_interval_however_often_it_is_scraped(monkeypatch):
    import asyncio

    from rayserve_paged.deployments import fleet_metrics

    listings = []

    def names(app_name):
        listings.append(app_name)
        return []  # no replica answers: an empty (valid) exposition

    monkeypatch.setattr(fleet_metrics, "fleet_scheduler_names", names)
    now = [100.0]
    cache = fleet_metrics.FleetMetricsCache("llm", ttl_s=2.0, clock=lambda: now[0])
    assert await asyncio.gather(*(cache.text() for _ in range(20))) == [""] * 20  # one refresh, shared
    assert listings == ["llm"]
    now[0] += 1.9
    await cache.text()
    assert listings == ["llm"]  # still within the interval
    now[0] += 0.2
    await cache.text()
    assert listings == ["llm", "llm"]


async def test_a_failed_fleet_refresh_is_not_kept():
    from rayserve_paged.deployments.fleet_metrics import FleetMetricsCache

    calls = []

    async def fetch(app_name):
        calls.append(app_name)
        if len(calls) == 1:
            raise ConnectionError("GCS unreachable")
        return "# text\n"

    cache = FleetMetricsCache("llm", ttl_s=60.0, fetch=fetch)
    with pytest.raises(ConnectionError):
        await cache.text()
    assert await cache.text() == "# text\n" and await cache.text() == "# text\n"
    assert calls == ["llm", "llm"]


def test_metrics_cache_s_reaches_the_replica(monkeypatch):
    from rayserve_paged.app import AppArgs

    from .conftest import record_binds

    assert AppArgs(model="tiny-opt").metrics_cache_s == 2.0
    bound = record_binds(monkeypatch, AppArgs(model="tiny-opt", device="cpu", metrics_cache_s=0.5))
    assert bound["LLMServer"]["kwargs"]["metrics_cache_s"] == 0.5
