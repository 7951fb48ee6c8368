"""The package's own promises: light to import, and the replica facade's GPU poll clock."""

from __future__ import annotations

import subprocess
import sys

from rayserve_paged.telemetry import ReplicaTelemetry, TelemetryConfig


def test_importing_telemetry_loads_neither_ray_torch_pynvml_nor_the_engine():
    code = (
        "import sys, rayserve_paged.telemetry\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'torch', 'pynvml') or "
        "m.startswith(('rayserve_paged.engine', 'rayserve_paged.worker', 'rayserve_paged.deployments'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_gpu_poll_is_due_once_per_interval(swap_run):
    telemetry = ReplicaTelemetry(swap_run.engine, TelemetryConfig(gpu_poll_interval_s=5))
    try:
        assert telemetry.is_gpu_poll_due(100.0)  # at once after start-up
        assert not telemetry.is_gpu_poll_due(104.9)
        assert telemetry.is_gpu_poll_due(105.0)
        assert not telemetry.is_gpu_poll_due(105.1)
    finally:
        telemetry.shutdown()
