"""OTLP/HTTP export to a receiver on loopback, switched on by the standard variables."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from rayserve_paged.telemetry import HISTOGRAM_BUCKETS_S, ReplicaTelemetry, TelemetryConfig, otlp_requested
from rayserve_paged.telemetry import names

from .conftest import NUM_REQUESTS
from .readings import Readings


class _Receiver(BaseHTTPRequestHandler):
    """Accepts POST /v1/metrics like a collector; keeps the decoded requests."""

    received: list[ExportMetricsServiceRequest]

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/metrics":
            self.send_response(404)
            self.end_headers()
            return
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        self.received.append(request)
        reply = ExportMetricsServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    handler = type("Receiver", (_Receiver,), {"received": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], handler.received
    server.shutdown()
    server.server_close()


def test_the_same_metrics_arrive_over_otlp(swap_run, receiver, monkeypatch):
    port, received = receiver
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    telemetry = ReplicaTelemetry(swap_run.engine, TelemetryConfig(replica="otlp-replica", export_interval_s=3600))
    try:
        telemetry.record_outputs(swap_run.finished)
        assert telemetry.provider.force_flush(timeout_millis=10_000)
    finally:
        telemetry.shutdown()

    assert received, "nothing reached the receiver"
    r = Readings.from_otlp(received[0])
    engine = swap_run.engine
    preemptions = r.value(names.SCHEDULER_PREEMPTIONS, mode="swap", replica="otlp-replica")
    assert preemptions == engine.scheduler.counters.preemptions_swap > 0
    assert r.value(names.KV_CACHE_SWAPPED_BLOCKS, direction="out") == engine.block_manager.counters.swapped_out_blocks
    assert r.monotonic[names.KV_CACHE_SWAPPED_BLOCKS]
    assert r.value(names.KV_CACHE_BLOCKS, pool="device", state="used") == 0
    assert r.value(names.TOKENS, type="prompt") == engine.num_prompt_tokens
    assert r.value(names.REQUEST_FINISHED, finish_reason="length") == NUM_REQUESTS
    ttft = r.point(names.REQUEST_TIME_TO_FIRST_TOKEN)
    assert ttft.count == NUM_REQUESTS
    assert ttft.explicit_bounds == list(HISTOGRAM_BUCKETS_S[names.REQUEST_TIME_TO_FIRST_TOKEN])
    resource = {kv.key: kv.value.string_value for kv in received[0].resource_metrics[0].resource.attributes}
    assert resource["service.name"] == "rayserve-paged"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://collector:4318/v1/metrics"}, True),
        ({"OTEL_METRICS_EXPORTER": "otlp"}, True),
        ({"OTEL_METRICS_EXPORTER": "prometheus, otlp"}, True),
        ({"OTEL_METRICS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ],
)
def test_otlp_is_switched_on_by_the_standard_variables(env, expected):
    assert otlp_requested(env) is expected
