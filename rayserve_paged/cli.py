"""The `rayserve-paged` command."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module in the top-level `benchmarks` package; each has main(argv) -> int
BENCHMARKS = {
    "memory": "benchmarks.memory",
    "scheduler": "benchmarks.scheduler_step",
}


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        names = ", ".join(sorted(BENCHMARKS))
        print(f"usage: rayserve-paged bench {{{names}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rayserve-paged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="run a benchmark: rayserve-paged bench NAME --out DIR", add_help=False)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    parser.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
