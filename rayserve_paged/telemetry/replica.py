"""ReplicaTelemetry: everything one replica measures, owned by its scheduler actor.

The scheduler actor's wiring, in full:

    self.telemetry = ReplicaTelemetry(self.engine, telemetry_config)     # after the engine exists
    self.telemetry.record_outputs(outputs)                               # step loop, each step
    if self.telemetry.is_gpu_poll_due():                                 # step loop, between steps
        self.telemetry.update_gpu(self.engine.executor.gpu_snapshots())
    self.telemetry.metrics_text()                                        # GET /metrics
    self.telemetry.shutdown()                                            # actor shutdown
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.sdk.metrics.export import MetricReader

from rayserve_paged.telemetry.config import TelemetryConfig
from rayserve_paged.telemetry.engine_metrics import EngineLike, EngineMetrics
from rayserve_paged.telemetry.export import render_prometheus, setup_meter_provider, shutdown_meter_provider
from rayserve_paged.telemetry.gpu import GpuMetrics, GpuSnapshot


class ReplicaTelemetry:
    def __init__(
        self, engine: EngineLike, config: TelemetryConfig | None = None, readers: Iterable[MetricReader] = ()
    ) -> None:
        self.config = config or TelemetryConfig()
        self.provider = setup_meter_provider(self.config, readers)
        self.engine_metrics = EngineMetrics(self.provider, engine, self.config.replica)
        self.gpu_metrics = GpuMetrics(self.provider, self.config.replica)
        self._next_gpu_poll = 0.0  # monotonic time; 0 = poll at the first chance

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def record_outputs(self, outputs: Iterable) -> None:
        """Record every finished output of a step (unfinished ones are skipped)."""
        if not self.config.enabled:
            return
        for out in outputs:
            if out.finished:
                self.engine_metrics.record_finished(out)

    def record_aborted(self) -> None:
        if self.config.enabled:
            self.engine_metrics.record_aborted()

    def is_gpu_poll_due(self, now: float | None = None) -> bool:
        """True once per gpu_poll_interval_s; the caller then gathers and calls update_gpu."""
        if not self.config.enabled:
            return False
        now = time.monotonic() if now is None else now
        if now < self._next_gpu_poll:
            return False
        self._next_gpu_poll = now + self.config.gpu_poll_interval_s
        return True

    def update_gpu(self, snapshots: Iterable[GpuSnapshot | Mapping[str, Any] | None]) -> None:
        self.gpu_metrics.update(snapshots)

    def metrics_text(self) -> str:
        """Prometheus text of this replica's metrics ("" when telemetry is off)."""
        return render_prometheus(self.provider) if self.config.enabled else ""

    def shutdown(self) -> None:
        shutdown_meter_provider(self.provider)
