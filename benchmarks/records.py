"""What every benchmark's JSON goes through: one writer (`write_json`), which adds the
machine the figures were measured on (`machine`: platform, CPU, load, versions); the
host-time benchmarks' results record (`write_record`) on top of it; the load average read
one way (`load_average`); and a baseline module loaded from a file.

Together with benchmarks/metrics.py (percentiles, medians) and benchmarks/options.py (the
common arguments) this is the harness the benchmarks share; each benchmark file holds only
its workload, its measurement and its report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys

# packages whose versions a record names, when the benchmark has imported them
VERSIONED = ("torch", "triton", "transformers", "numpy", "ray", "pydantic", "xgrammar", "rayserve_paged")


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages now (None where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def commit() -> str | None:
    """The project's commit the benchmark ran from ("-dirty" with uncommitted changes to
    tracked files); None outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()  # fmt: skip
        changed = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if changed else "")


def machine() -> dict:
    """The machine a record was made on: platform, CPU, the load average when it was
    written, Python, the versions of the packages the benchmark imported and the commit."""
    versions = {"python": platform.python_version()}
    for name in VERSIONED:
        module = sys.modules.get(name)  # only what the benchmark imported itself; None: blocked
        version = getattr(module, "__version__", None) if module is not None else None
        if version is not None:
            versions[name] = str(version)
    return {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": load_average(),
        "versions": versions,
        "commit": commit(),
    }


def write_json(out_dir, file_name: str, record: dict) -> str:
    """Write `record` to `out_dir/file_name` (the folder made if needed), with the machine
    record under "machine" (added to `record` itself too, for the benchmark's own report).
    The one writer of benchmark JSON; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    record["machine"] = machine()
    path = os.path.join(out_dir, file_name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return path


def write_record(out_dir: str, benchmark: str, results: dict, **extra) -> str:
    """`<out_dir>/<benchmark with _ for ->.json`: {"benchmark", **extra, "results"}; its path."""
    record = {"benchmark": benchmark, **extra, "results": results}
    return write_json(out_dir, benchmark.replace("-", "_") + ".json", record)


def load_module(path: str, name: str):
    """The Python file at `path` as a module called `name` (a baseline version of a module)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def print_rows(title: str, results: dict, width: int) -> None:
    print(title)
    for case, row in results.items():
        print(f"  {case:{width}s} " + "  ".join(f"{key}={value}" for key, value in row.items()))


def report_rows(title: str, results: dict, width: int, out_dir: str | None, benchmark: str, **extra) -> None:
    """The host-time benchmarks' end: a row per case on stdout, then the record if asked."""
    print_rows(title, results, width)
    if out_dir:
        write_record(out_dir, benchmark, results, **extra)


def progress(message: str) -> None:
    """A progress line, on stderr: stdout holds only the report."""
    print(message, file=sys.stderr)


def write_report(out_dir, file_name: str, record: dict, format_report, *also: str) -> str:
    """write_json, then the benchmark's report of the record and where it went (`also`:
    other files the benchmark wrote beside it); the JSON's path."""
    path = write_json(out_dir, file_name, record)
    print(format_report(record))
    print("\nwrote " + " and ".join([path, *also]))
    return path
