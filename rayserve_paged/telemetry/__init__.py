"""OpenTelemetry metrics: KV cache, scheduler, request latency, GPU memory per TP rank.

Imports neither ray nor the engine (the engine, workers and deployments import this).
docs/TELEMETRY.md lists every metric.
"""

from rayserve_paged.telemetry.config import TelemetryConfig
from rayserve_paged.telemetry.engine_metrics import EngineMetrics, finish_reason
from rayserve_paged.telemetry.export import (
    HISTOGRAM_BUCKETS_S,
    PROMETHEUS_CONTENT_TYPE,
    otlp_requested,
    prometheus_server_port,
    render_prometheus,
    setup_meter_provider,
    shutdown_meter_provider,
)
from rayserve_paged.telemetry.gpu import GpuMetrics, GpuProbe, GpuSnapshot, tensor_bytes
from rayserve_paged.telemetry.merge import merge_prometheus, render_families
from rayserve_paged.telemetry.replica import ReplicaTelemetry

__all__ = [
    "HISTOGRAM_BUCKETS_S",
    "PROMETHEUS_CONTENT_TYPE",
    "EngineMetrics",
    "GpuMetrics",
    "GpuProbe",
    "GpuSnapshot",
    "ReplicaTelemetry",
    "TelemetryConfig",
    "finish_reason",
    "merge_prometheus",
    "otlp_requested",
    "prometheus_server_port",
    "render_families",
    "render_prometheus",
    "setup_meter_provider",
    "shutdown_meter_provider",
    "tensor_bytes",
]
