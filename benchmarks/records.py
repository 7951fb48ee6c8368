"""The JSON record a host-time benchmark writes: its results, the machine and the load."""

from __future__ import annotations

import json
import os
import platform


def write_record(out_dir: str, benchmark: str, results: dict, **extra) -> str:
    """Write `<out_dir>/<benchmark with _ for ->.json`; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    record = {
        "benchmark": benchmark,
        "machine": platform.platform(),
        "loadavg": open("/proc/loadavg").read().strip() if os.path.exists("/proc/loadavg") else None,
        **extra,
        "results": results,
    }
    path = os.path.join(out_dir, benchmark.replace("-", "_") + ".json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    return path
