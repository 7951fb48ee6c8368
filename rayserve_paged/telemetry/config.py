"""User-facing telemetry settings (pydantic at the edge, validated once)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TelemetryConfig(BaseModel):
    """Where a replica's metrics go. OTLP is switched on by the standard environment
    variables (OTEL_METRICS_EXPORTER=otlp, or OTEL_EXPORTER_OTLP[_METRICS]_ENDPOINT), not here."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Measure at all; off makes every telemetry call a no-op.")
    replica: str = Field("0", min_length=1, description="Value of the `replica` label (the Serve replica id).")
    prometheus_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Also serve Prometheus text over HTTP on this port (besides GET /metrics); "
        "None = no server. Several replicas on one node cannot share a port: the later ones log and go on.",
    )
    prometheus_host: str = Field("0.0.0.0", description="Address the Prometheus HTTP server binds.")
    export_interval_s: float | None = Field(
        None,
        gt=0,
        description="OTLP push interval in seconds; None = OTEL_METRIC_EXPORT_INTERVAL, else 60 s.",
    )
    gpu_poll_interval_s: float = Field(
        5.0, gt=0, description="How often the scheduler actor gathers its workers' GPU snapshots."
    )
