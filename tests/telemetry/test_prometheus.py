"""Prometheus text: what GET /metrics serves, parsed back with prometheus_client."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rayserve_paged.telemetry import (
    GpuSnapshot,
    ReplicaTelemetry,
    TelemetryConfig,
    prometheus_server_port,
    render_prometheus,
    setup_meter_provider,
)
from rayserve_paged.telemetry import names

from .conftest import MAX_TOKENS, NUM_REQUESTS, REPLICA

DOCS = Path(__file__).resolve().parents[2] / "docs" / "TELEMETRY.md"


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict, family: str, sample_name: str | None = None, **labels) -> float:
    found = [
        s.value
        for s in fams[family].samples
        if s.name == (sample_name or family) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (family, sample_name, labels, fams[family].samples)
    return found[0]


@pytest.fixture(scope="module")
def full_text(swap_run) -> str:
    """The swap run's metrics with one faked GPU rank, so every instrument is present."""
    swap_run.telemetry.update_gpu([_full_snapshot(rank=0, gpu_index=3), _full_snapshot(rank=1, gpu_index=5).to_dict()])
    text = swap_run.telemetry.metrics_text()
    swap_run.telemetry.update_gpu([])
    return text


def _full_snapshot(rank: int, gpu_index: int) -> GpuSnapshot:
    return GpuSnapshot(
        rank, "cuda:0", kv_cache_bytes=1000 + rank, cpu_swap_bytes=2000 + rank, gpu_index=gpu_index,
        gpu_uuid=f"GPU-{gpu_index}", gpu_name="NVIDIA H200", memory_used_bytes=30, memory_free_bytes=70,
        memory_total_bytes=100, utilization=0.25, torch_allocated_bytes=11, torch_reserved_bytes=12,
        torch_peak_allocated_bytes=13,
    )  # fmt: skip


def test_engine_metrics_parse_with_the_replica_label_and_the_run_values(swap_run, full_text):
    fams = families(full_text)
    engine = swap_run.engine
    assert fams["rayserve_paged_scheduler_preemptions"].type == "counter"
    assert sample(fams, "rayserve_paged_scheduler_preemptions", "rayserve_paged_scheduler_preemptions_total",
                  mode="swap", replica=REPLICA) == engine.scheduler.counters.preemptions_swap  # fmt: skip
    blocks = engine.block_manager.counters
    assert sample(fams, "rayserve_paged_kv_cache_swapped_blocks", "rayserve_paged_kv_cache_swapped_blocks_total",
                  direction="out", replica=REPLICA) == blocks.swapped_out_blocks  # fmt: skip
    generated = sample(fams, "rayserve_paged_tokens", "rayserve_paged_tokens_total", type="generation")
    assert generated == NUM_REQUESTS * MAX_TOKENS
    assert fams["rayserve_paged_kv_cache_usage"].type == "gauge"
    assert sample(fams, "rayserve_paged_kv_cache_usage", pool="device", replica=REPLICA) == 0.0
    assert sample(fams, "rayserve_paged_kv_cache_blocks", pool="device", state="free") == 12
    assert sample(fams, "rayserve_paged_scheduler_requests", state="waiting") == 0
    assert sample(fams, "rayserve_paged_request_finished", "rayserve_paged_request_finished_total",
                  finish_reason="length") == NUM_REQUESTS  # fmt: skip


def test_latency_histograms_are_in_seconds(full_text):
    fams = families(full_text)
    ttft = "rayserve_paged_request_time_to_first_token_seconds"
    assert fams[ttft].type == "histogram"
    assert sample(fams, ttft, ttft + "_count", replica=REPLICA) == NUM_REQUESTS
    assert sample(fams, ttft, ttft + "_bucket", le="+Inf") == NUM_REQUESTS
    assert 0 < sample(fams, ttft, ttft + "_sum") < 60  # seconds, not milliseconds
    for family in (
        "rayserve_paged_request_time_per_output_token_seconds",
        "rayserve_paged_request_e2e_latency_seconds",
        "rayserve_paged_request_queue_time_seconds",
    ):
        assert sample(fams, family, family + "_count") == NUM_REQUESTS


def test_gpu_metrics_carry_rank_device_and_replica(full_text):
    fams = families(full_text)
    labels = dict(replica=REPLICA, tp_rank="1", gpu_index="5", hw_id="GPU-5", hw_name="NVIDIA H200")
    assert sample(fams, "hw_gpu_memory_usage_bytes", **labels) == 30
    assert sample(fams, "hw_gpu_memory_limit_bytes", **labels) == 100
    assert sample(fams, "rayserve_paged_gpu_memory_free_bytes", **labels) == 70
    assert sample(fams, "hw_gpu_memory_utilization", **labels) == pytest.approx(0.3)
    assert sample(fams, "hw_gpu_utilization", hw_gpu_task="general", **labels) == 0.25
    assert sample(fams, "rayserve_paged_torch_memory_allocated_bytes", **labels) == 11
    assert sample(fams, "rayserve_paged_torch_memory_reserved_bytes", **labels) == 12
    assert sample(fams, "rayserve_paged_torch_memory_peak_allocated_bytes", **labels) == 13
    assert sample(fams, "rayserve_paged_kv_cache_memory_bytes", pool="device", **labels) == 1001
    assert sample(fams, "rayserve_paged_kv_cache_memory_bytes", pool="cpu", tp_rank="0", gpu_index="3") == 2000


def test_docs_list_every_metric_with_its_prometheus_name(full_text):
    doc = DOCS.read_text()
    rendered = {f.name for f in text_string_to_metric_families(full_text)} - {"target_info"}
    all_names = names.ENGINE_INSTRUMENTS + names.RANK_INSTRUMENTS
    assert len(rendered) == len(set(all_names)) == len(all_names)  # one family per instrument
    for name in all_names:
        assert f"`{name}`" in doc, name
    for family in rendered:
        counter = f"`{family}_total`" in doc
        assert counter or f"`{family}`" in doc, family


def test_two_providers_do_not_mix(swap_run):
    other = ReplicaTelemetry(swap_run.engine, TelemetryConfig(replica="replica-b"))
    try:
        text = other.metrics_text()
        assert 'replica="replica-b"' in text and f'replica="{REPLICA}"' not in text
        # nothing was recorded here: the histograms and the finished counter have no points yet
        assert "time_to_first_token" not in text
    finally:
        other.shutdown()


def test_prometheus_http_server_serves_the_same_metrics(swap_run):
    config = TelemetryConfig(replica="served", prometheus_port=0, prometheus_host="127.0.0.1")
    server = ReplicaTelemetry(swap_run.engine, config)
    try:
        port = prometheus_server_port(server.provider)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        fams = families(body)
        assert sample(fams, "rayserve_paged_kv_cache_blocks", pool="device", state="free", replica="served") == 12
        assert families(server.metrics_text()).keys() == fams.keys()
    finally:
        server.shutdown()
    assert prometheus_server_port(server.provider) is None


def test_a_taken_port_is_logged_not_raised(swap_run, caplog):
    first = ReplicaTelemetry(swap_run.engine, TelemetryConfig(prometheus_port=0, prometheus_host="127.0.0.1"))
    try:
        port = prometheus_server_port(first.provider)
        second = ReplicaTelemetry(swap_run.engine, TelemetryConfig(prometheus_port=port, prometheus_host="127.0.0.1"))
        assert prometheus_server_port(second.provider) is None
        assert "rayserve_paged_kv_cache_blocks" in second.metrics_text()
        assert any("not started" in r.getMessage() for r in caplog.records)
        second.shutdown()
    finally:
        first.shutdown()


def test_disabled_telemetry_renders_nothing(swap_run):
    off = ReplicaTelemetry(swap_run.engine, TelemetryConfig(enabled=False))
    assert off.metrics_text() == ""
    assert not off.is_gpu_poll_due()
    off.record_outputs(swap_run.finished)  # a no-op, not an error
    with pytest.raises(ValueError, match="setup_meter_provider"):
        render_prometheus(setup_meter_provider(TelemetryConfig(enabled=False)))
    off.shutdown()


def test_merged_replicas_declare_each_family_once_and_keep_every_sample(swap_run, full_text):
    """What GET /metrics serves for a fleet: two replicas' texts merged into one exposition."""
    from rayserve_paged.telemetry import merge_prometheus

    other = ReplicaTelemetry(swap_run.engine, TelemetryConfig(replica="replica-b"))
    try:
        other.update_gpu([_full_snapshot(rank=0, gpu_index=4)])
        texts = [full_text, other.metrics_text()]
    finally:
        other.shutdown()
    merged = merge_prometheus(texts)
    type_lines = [line for line in merged.splitlines() if line.startswith("# TYPE ")]
    assert len(type_lines) == len(set(type_lines))  # one header per family (concatenation has two)
    fams = families(merged)
    parts = [families(t) for t in texts]
    assert fams.keys() == parts[0].keys() | parts[1].keys()
    for name, family in fams.items():
        got = sorted(_keyed(family.samples))
        assert got == sorted({k for p in parts if name in p for k in _keyed(p[name].samples)}), name
        assert len(got) == len(set(got))
        assert family.type == next(p[name].type for p in parts if name in p)
    replicas = {s.labels.get("replica") for s in fams["rayserve_paged_kv_cache_blocks"].samples}
    assert replicas == {REPLICA, "replica-b"}
    ranks = {(s.labels["replica"], s.labels["gpu_index"]) for s in fams["hw_gpu_memory_usage_bytes"].samples}
    assert ranks == {(REPLICA, "3"), (REPLICA, "5"), ("replica-b", "4")}
    assert families(merge_prometheus([full_text])).keys() == parts[0].keys()


def _keyed(samples) -> list[tuple]:
    return [(s.name, tuple(sorted(s.labels.items())), s.value) for s in samples]
