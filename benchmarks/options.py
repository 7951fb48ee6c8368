"""The arguments every benchmark takes, one way: --out (the folder for its JSON), --seed
(where it draws random inputs) and --quick (seconds, for tests: a smaller workload); and
the engine-run sizes (--threads, --num-requests, --max-tokens, --rounds); the host-time
benchmarks' own set on top (--steps, --warmup, --cases, a baseline file)."""

from __future__ import annotations

import argparse


def benchmark_parser(
    prog: str,
    description: str,
    *,
    out_help: str,
    out_required: bool = False,
    out_default: str | None = None,
    seed: int | None = 0,
    quick_help: str = "seconds, for tests: a smaller workload",
) -> argparse.ArgumentParser:
    """A parser with --out, --seed (default `seed`; none when `seed` is None: nothing random
    to seed) and --quick; the benchmark adds its own arguments."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", required=out_required, default=out_default, help=out_help)
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def add_engine_run_arguments(parser: argparse.ArgumentParser, *, threads: int, num_requests: int, max_tokens: int,
                             rounds_help: str) -> None:
    """--threads, --num-requests, --max-tokens (defaults given) and --rounds (default 1): the
    size of a benchmark's timed engine runs over a fixed set of requests."""
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--num-requests", type=int, default=num_requests)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--rounds", type=int, default=1, help=rounds_help)


def host_time_parser(prog: str, description: str, cases: dict, *, out_name: str, baseline_help: str,
                     baseline_flag: str = "--baseline") -> argparse.ArgumentParser:
    """The common arguments (--quick: QUICK_STEPS timed steps after QUICK_WARMUP) and
    --steps, --warmup, --cases (comma-separated names of `cases`) and the baseline file."""
    parser = benchmark_parser(prog, description, out_help=f"directory for {out_name}",
                              quick_help=f"{QUICK_STEPS} timed steps after {QUICK_WARMUP} (for tests)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--cases", default=",".join(cases), help=f"comma-separated: {', '.join(cases)}")
    parser.add_argument(baseline_flag, help=baseline_help)
    return parser


QUICK_STEPS, QUICK_WARMUP = 30, 5


def parse_host_time_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """host_time_parser's arguments, --quick applied to --steps and --warmup."""
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = QUICK_STEPS, QUICK_WARMUP
    return args


def time_cases(parser: argparse.ArgumentParser, args: argparse.Namespace, cases: dict, time_case) -> dict:
    """{case: time_case(case)} for the cases --cases names, in that order (one thread)."""
    import torch

    torch.set_num_threads(1)
    return {case: time_case(case) for case in chosen_cases(parser, cases, args.cases)}


def chosen_cases(parser: argparse.ArgumentParser, cases: dict, names: str) -> list[str]:
    """The comma-separated case names, each one of `cases` (else the parser's error)."""
    chosen = names.split(",")
    for name in chosen:
        if name not in cases:
            parser.error(f"unknown case {name!r}")
    return chosen
