"""Host time of sampling one step: building the sampler's batch plus the sampler call.

One step of NUM_ROWS running decodes, one sequence per request, parameters cached per
request (the worker keeps them), logits [NUM_ROWS, vocab] float32 on CPU. Timed per step
(time.perf_counter_ns, after warm-up), Python's garbage collector enabled:

    build   worker/sampling_inputs.batch_from_groups(groups, cached row templates)
    sample  Sampler(logits, batch)
    total   both

The vocabulary is small by default (256) so that the figure is the host's Python and
torch dispatch, not the CPU doing a GPU's arithmetic; pass --vocab for a real one.

Cases:

  greedy_256   every row greedy, no logprobs: the sampler's fast path
  sampled_256  temperature 0.8, top-p 0.9, each request seeded: the general path

--baseline-sampler FILE times, interleaved step by step with the current code, a
sampler module from FILE with the call shape it had before SamplingBatch:
Sampler()(logits, groups, group_params), e.g. the file as of commit a4299eb:

    git show a4299eb:rayserve_paged/models/sampler.py > /tmp/sampler_before.py
    rayserve-paged bench sampler-host --baseline-sampler /tmp/sampler_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

from rayserve_paged.core.outputs import ScheduledGroup, ScheduledSeq
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.models.sampler import Sampler
from rayserve_paged.worker.sampling_inputs import batch_from_groups, row_template

NUM_ROWS = 256
EOS = (2,)
CASES = {
    "greedy_256": dict(temperature=0.0, max_tokens=None),
    "sampled_256": dict(temperature=0.8, top_p=0.9, max_tokens=None),
}


def build_step(case: str, seed: int) -> tuple[list[ScheduledGroup], list[SamplingParams]]:
    rng = random.Random(seed)
    groups, params = [], []
    for i in range(NUM_ROWS):
        extra = {"seed": rng.randrange(1 << 30)} if case == "sampled_256" else {}
        p = SamplingParams(**CASES[case], **extra)
        seq = ScheduledSeq(i, [rng.randrange(1000)], 300, [i], rng.randint(1, 200), 0)
        groups.append(ScheduledGroup(f"r{i}", [seq], None, 100, False))
        params.append(p)
    return groups, params


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("sampler_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.Sampler(len(EOS), EOS)


def time_case(case: str, vocab: int, steps: int, warmup: int, seed: int, baseline) -> dict:
    groups, params = build_step(case, seed)
    templates = [row_template(p, EOS) for p in params]  # once per request, as the worker caches them
    logits = torch.randn(NUM_ROWS, vocab, generator=torch.Generator().manual_seed(seed))  # [rows, vocab]
    sampler = Sampler(len(EOS), EOS)
    build_ns, total_ns, before_ns = [], [], []
    for step in range(warmup + steps):
        start = time.perf_counter_ns()
        batch = batch_from_groups(groups, templates)
        built = time.perf_counter_ns()
        out = sampler(logits, batch)
        done = time.perf_counter_ns()
        if baseline is not None:
            b_start = time.perf_counter_ns()
            before = baseline(logits, groups, params)
            b_done = time.perf_counter_ns()
            if case == "greedy_256" and [s.token_ids for s in before.samples] != [s.token_ids for s in out.samples]:
                raise AssertionError("the baseline sampler chose other greedy tokens")
        if step >= warmup:
            build_ns.append(built - start)
            total_ns.append(done - start)
            if baseline is not None:
                before_ns.append(b_done - b_start)
    us = lambda values: round(statistics.median(values) / 1000, 1)  # noqa: E731
    row = {"build_us": us(build_ns), "sample_us": us([t - b for t, b in zip(total_ns, build_ns)]), "total_us": us(total_ns)}
    if baseline is not None:
        row["baseline_total_us"] = us(before_ns)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayserve-paged bench sampler-host", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    parser.add_argument("--baseline-sampler", help="a sampler.py with the old call shape, timed alongside")
    parser.add_argument("--out", help="directory for sampler_host.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    baseline = load_baseline(args.baseline_sampler) if args.baseline_sampler else None
    results = {}
    for case in args.cases.split(","):
        if case not in CASES:
            parser.error(f"unknown case {case!r}")
        results[case] = time_case(case, args.vocab, args.steps, args.warmup, args.seed, baseline)
    print(f"sampler host time, {NUM_ROWS} rows, vocab {args.vocab} (median us per step)")
    for case, row in results.items():
        print(f"  {case:12s} " + "  ".join(f"{key}={value}" for key, value in row.items()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = {
            "benchmark": "sampler-host",
            "machine": platform.platform(),
            "loadavg": open("/proc/loadavg").read().strip() if os.path.exists("/proc/loadavg") else None,
            "vocab": args.vocab,
            "results": results,
        }
        with open(os.path.join(args.out, "sampler_host.json"), "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
