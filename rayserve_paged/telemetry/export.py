"""The MeterProvider of a measuring process and where its metrics go.

    instruments ──> MeterProvider ──> PrometheusMetricReader (private registry)
                                 │        ├─ render_prometheus(provider)   (GET /metrics)
                                 │        └─ HTTP server on prometheus_port (optional)
                                 ├──> PeriodicExportingMetricReader(OTLP/HTTP)  (env-driven)
                                 └──> readers given by the caller (tests: InMemoryMetricReader)

Each provider gets its own Prometheus registry (never the process-global one), so several
providers in one process (tests, two replicas' actors on one worker) never mix.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterable, Mapping

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from rayserve_paged.telemetry import names
from rayserve_paged.telemetry.config import TelemetryConfig

logger = logging.getLogger(__name__)

# What render_prometheus returns: the text format 0.0.4 (give it as GET /metrics' media type)
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket upper bounds in seconds. OTel's default bounds (0, 5, 10, 25, ... 10000) suit
# milliseconds; these cover a CPU toy model (ms) up to long generations on a busy GPU (min).
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
TPOT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8,
    1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
QUEUE_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip

HISTOGRAM_BUCKETS_S: dict[str, tuple[float, ...]] = {
    names.REQUEST_TIME_TO_FIRST_TOKEN: TTFT_BUCKETS_S,
    names.REQUEST_TIME_PER_OUTPUT_TOKEN: TPOT_BUCKETS_S,
    names.REQUEST_E2E_LATENCY: E2E_BUCKETS_S,
    names.REQUEST_QUEUE_TIME: QUEUE_BUCKETS_S,
}


def histogram_views() -> list[View]:
    return [
        View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(boundaries=bounds))
        for name, bounds in HISTOGRAM_BUCKETS_S.items()
    ]


class _PrometheusEndpoint:
    """A provider's Prometheus reader and registry. One collection at a time: the exporter
    queues each collection's data and drains the queue on output, so two concurrent scrapes
    could leave one of them empty. The lock serialises GET /metrics and the HTTP server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.reader = PrometheusMetricReader(registry=self.registry, scope_info_enabled=False)
        self._lock = threading.Lock()
        self.server = None  # (WSGIServer, Thread) when prometheus_port is set

    def collect(self):  # the prometheus_client Collector protocol, for the HTTP server
        with self._lock:
            families = list(self.registry.collect())
        return iter(families)

    def restricted_registry(self, names_):  # ?name[]=... on the HTTP server: serve all
        return self

    def render(self) -> str:
        return generate_latest(self).decode()

    def serve(self, host: str, port: int) -> None:
        try:
            self.server = start_http_server(port, addr=host, registry=self)
        except OSError as e:  # another replica on this node holds the port
            logger.warning("Prometheus HTTP server not started on %s:%d (%s); GET /metrics still works", host, port, e)
            return
        logger.info("Prometheus metrics on http://%s:%d/metrics", host, self.server[0].server_port)

    def close(self) -> None:
        if self.server is not None:
            self.server[0].shutdown()
            self.server[0].server_close()
            self.server = None


_endpoints: weakref.WeakKeyDictionary[MeterProvider, _PrometheusEndpoint] = weakref.WeakKeyDictionary()


def otlp_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """OTLP export is on when OTEL_METRICS_EXPORTER names otlp, or, when that variable is
    unset, when an OTLP endpoint is configured."""
    exporters = environ.get("OTEL_METRICS_EXPORTER")
    if exporters is not None:
        return "otlp" in {e.strip().lower() for e in exporters.split(",")}
    return bool(environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _otlp_reader(config: TelemetryConfig) -> MetricReader | None:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "http/protobuf":
        logger.warning("OTLP protocol %r is not installed; exporting with http/protobuf", protocol)
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    except ImportError as e:
        logger.warning("OTLP export asked for, but the OTLP/HTTP exporter does not import (%s)", e)
        return None
    interval_ms = None if config.export_interval_s is None else config.export_interval_s * 1000
    # endpoint, headers, timeout and compression come from the OTEL_EXPORTER_OTLP_* variables
    return PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=interval_ms)


def _resource() -> Resource:
    env_attrs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in env_attrs
    return Resource.create({} if named else {SERVICE_NAME: "rayserve-paged"})


def setup_meter_provider(config: TelemetryConfig | None = None, readers: Iterable[MetricReader] = ()) -> MeterProvider:
    """A MeterProvider with the latency-histogram views, a Prometheus reader (for
    render_prometheus), OTLP when the environment asks for it, and `readers`.

    The provider is not made global: pass it to EngineMetrics / GpuMetrics. With
    config.enabled False it has no readers, so no callback ever runs."""
    config = config or TelemetryConfig()
    if not config.enabled:
        return MeterProvider(metric_readers=[], views=histogram_views())
    endpoint = _PrometheusEndpoint()
    all_readers: list[MetricReader] = [endpoint.reader, *readers]
    if otlp_requested():
        otlp = _otlp_reader(config)
        if otlp is not None:
            all_readers.append(otlp)
    provider = MeterProvider(metric_readers=all_readers, resource=_resource(), views=histogram_views())
    _endpoints[provider] = endpoint
    if config.prometheus_port is not None:
        endpoint.serve(config.prometheus_host, config.prometheus_port)
    return provider


def render_prometheus(provider: MeterProvider) -> str:
    """The provider's current metrics as Prometheus text exposition (format 0.0.4).

    Collecting runs the observable callbacks, so the values are as of this call."""
    endpoint = _endpoints.get(provider)
    if endpoint is None:
        raise ValueError("this MeterProvider was not made by setup_meter_provider with telemetry enabled")
    return endpoint.render()


def prometheus_server_port(provider: MeterProvider) -> int | None:
    """The port the provider's Prometheus HTTP server listens on (None: no server)."""
    endpoint = _endpoints.get(provider)
    if endpoint is None or endpoint.server is None:
        return None
    return endpoint.server[0].server_port


def shutdown_meter_provider(provider: MeterProvider) -> None:
    """Stop the HTTP server, flush OTLP, release the readers."""
    endpoint = _endpoints.pop(provider, None)
    if endpoint is not None:
        endpoint.close()
    provider.shutdown()
