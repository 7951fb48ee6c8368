"""What the host-time benchmarks share: their common options, a baseline module loaded from
a file, and the JSON record each writes (its results, the machine and the load)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys


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


def host_time_parser(prog: str, description: str, cases: dict, *, out_name: str, baseline_help: str,
                     baseline_flag: str = "--baseline") -> argparse.ArgumentParser:
    """--steps, --warmup, --seed, --cases (comma-separated names of `cases`), the baseline
    file option and --out."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", default=",".join(cases), help=f"comma-separated: {', '.join(cases)}")
    parser.add_argument(baseline_flag, help=baseline_help)
    parser.add_argument("--out", help=f"directory for {out_name}")
    return parser


def chosen_cases(parser: argparse.ArgumentParser, cases: dict, names: str) -> list[str]:
    """The comma-separated case names, each one of `cases` (else the parser's error)."""
    chosen = names.split(",")
    for name in chosen:
        if name not in cases:
            parser.error(f"unknown case {name!r}")
    return chosen


def load_module(path: str, name: str):
    """The Python file at `path` as a module called `name` (a baseline version of a module)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def median_us(values_ns: list[int]) -> float:
    return round(statistics.median(values_ns) / 1000, 1)


def print_rows(title: str, results: dict, width: int) -> None:
    print(title)
    for case, row in results.items():
        print(f"  {case:{width}s} " + "  ".join(f"{key}={value}" for key, value in row.items()))
