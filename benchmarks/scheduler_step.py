"""The CPU cost of one scheduler step: `Scheduler.schedule()`, pickling what goes to the
workers, and the step's bookkeeping.

Timed per step (time.perf_counter_ns, after warm-up steps):

    schedule()                          decode slots, admission, the step message
    + pickle.dumps(the step message)    what the Ray executor sends to every worker
    + append one sampled token to every scheduled sequence (no sequence finishes)

The step figure (median_us) is schedule + pickle; the bookkeeping is reported beside it.
Run against an older checkout of the package (PYTHONPATH), the pickled object is that
version's SchedulerOutput, which crossed to the workers whole.

Cases, block size 16, a GPU pool big enough that nothing is ever preempted:

  decode_256                  256 running sequences in decode (prompts 128-512 tokens),
                              prefix caching on (the BlockManager default)
  decode_256_no_prefix_cache  the same with prefix caching off
  decode_256_admit_64         256 running in decode + 64 new prompts (128-512 tokens)
                              waiting at the start of every step, all admitted by it
                              (budgets raised so they fit); after the timed step the 64
                              are aborted, untimed, so every step sees the same load

Each case runs several rounds, each a fresh scheduler with new prompts, warmed up then
timed, so sequence lengths stay near prompt + a few hundred tokens. Python's garbage
collector stays enabled, as in the engine.
"""

from __future__ import annotations

import pickle
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a file, maybe against an older checkout of the package on PYTHONPATH: the
    # harness beside this file (standard library only) is imported from here, the package
    # from PYTHONPATH.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks.metrics, benchmarks.options, benchmarks.records  # noqa: E401, F401

    del sys.path[0]

from benchmarks.metrics import percentile
from benchmarks.options import benchmark_parser
from benchmarks.records import write_report
from rayserve_paged.core.block_manager import BlockManager
from rayserve_paged.core.scheduler import Scheduler, SchedulerConfig
from rayserve_paged.core.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

BLOCK_SIZE = 16
NUM_RUNNING = 256
NUM_ARRIVING = 64
MIN_PROMPT, MAX_PROMPT = 128, 512
VOCAB = 50_000
TOKEN_POOL_SIZE = 1 << 16
TARGET_MEDIAN_US = 200.0
DEFAULT_SEED = 0


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    num_arriving: int
    enable_prefix_caching: bool


CASES = (
    Case("decode_256", 0, True),
    Case("decode_256_no_prefix_cache", 0, False),
    Case("decode_256_admit_64", NUM_ARRIVING, True),
)


class StepBench:
    """A scheduler with `NUM_RUNNING` sequences in decode and a fake model."""

    def __init__(self, case: Case, num_steps: int, seed: int) -> None:
        self.case = case
        self.rng = random.Random(f"scheduler-step-{case.name}-{seed}")
        # Prompts are random slices of one random token pool: distinct, and cheap to make.
        self.token_pool = [self.rng.randrange(VOCAB) for _ in range(TOKEN_POOL_SIZE)]
        # Longest sequence: MAX_PROMPT + every step's token; plus room for one step's arrivals.
        max_len = MAX_PROMPT + num_steps + 1
        blocks_per_seq = -(-max_len // BLOCK_SIZE) + 1
        num_gpu_blocks = (NUM_RUNNING + case.num_arriving) * blocks_per_seq
        self.max_model_len = max_len
        self.block_manager = BlockManager(
            block_size=BLOCK_SIZE,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=0,
            enable_prefix_caching=case.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=NUM_RUNNING + case.num_arriving,
                # Admission of all 64 arrivals (and of the initial 256 in one step) fits.
                max_num_batched_tokens=max(max_len, (NUM_RUNNING + case.num_arriving) * MAX_PROMPT),
                max_model_len=max_len,
            ),
            self.block_manager,
        )
        self.params = SamplingParams(max_tokens=None, temperature=0.0)
        self.next_id = 0
        self.step_index = 0
        for _ in range(NUM_RUNNING):
            self._add_request()
        self._step()  # prefill all 256: from here on they decode
        assert len(self.scheduler.running) == NUM_RUNNING and not self.scheduler.waiting

    def _add_request(self) -> str:
        prompt_len = self.rng.randint(MIN_PROMPT, MAX_PROMPT)
        start = self.rng.randrange(TOKEN_POOL_SIZE - prompt_len)
        prompt = self.token_pool[start : start + prompt_len]
        request_id = str(self.next_id)
        seq = Sequence(self.next_id, prompt)
        self.scheduler.add_group(SequenceGroup(request_id, [seq], self.params, 0.0, self.next_id))
        self.next_id += 1
        return request_id

    def _step(self) -> tuple[int, int, int, int, int]:
        """One step: schedule, pickle the step message, then append a sampled token to
        every scheduled sequence. Returns (groups scheduled, ns in schedule(), ns pickling,
        ns in the bookkeeping, bytes pickled)."""
        t0 = time.perf_counter_ns()
        out = self.scheduler.schedule()
        t1 = time.perf_counter_ns()
        wire = pickle.dumps(getattr(out, "message", out), protocol=pickle.HIGHEST_PROTOCOL)
        t2 = time.perf_counter_ns()
        groups = self.scheduler.groups
        token = self.step_index % VOCAB
        request_ids = [g[0].request_id for g in out.scheduled] if hasattr(out, "scheduled") else [
            g.request_id for g in out.groups  # an older checkout's SchedulerOutput (run as the baseline)
        ]
        for request_id in request_ids:
            for seq in groups[request_id].seqs:
                if seq.status is SequenceStatus.RUNNING:
                    seq.append_token(token)
                    token += 1
        self.step_index += 1
        t3 = time.perf_counter_ns()
        return len(request_ids), t1 - t0, t2 - t1, t3 - t2, len(wire)

    def timed_step(self) -> tuple[int, int, int, int]:
        """(ns in schedule(), ns pickling, ns in the bookkeeping, bytes) of one step;
        arrivals are added before and aborted after, untimed."""
        arrivals = [self._add_request() for _ in range(self.case.num_arriving)]
        num_groups, *timings = self._step()
        expected = NUM_RUNNING + self.case.num_arriving
        if num_groups != expected:
            raise RuntimeError(f"{self.case.name}: scheduled {num_groups} groups, expected {expected}")
        for request_id in arrivals:
            self.scheduler.abort(request_id)
        return tuple(timings)


def run_case(case: Case, num_rounds: int, num_warmup: int, num_steps: int, seed: int) -> dict:
    """`num_rounds` fresh schedulers (new prompts each), each warmed up then timed for
    `num_steps` steps, so sequences stay near their prompt lengths (prompt + at most
    num_warmup + num_steps tokens) rather than growing through one long run."""
    samples: list[tuple[int, int, int, int]] = []
    num_gpu_blocks = 0
    for round_index in range(num_rounds):
        bench = StepBench(case, num_warmup + num_steps, seed * 1000 + round_index)
        for _ in range(num_warmup):
            bench.timed_step()
        samples += [bench.timed_step() for _ in range(num_steps)]
        counters = bench.scheduler.counters
        if counters.preemptions_recompute or counters.preemptions_swap:
            raise RuntimeError(f"{case.name}: the pool was too small (a preemption happened)")
        num_gpu_blocks = bench.block_manager.gpu.num_blocks
    step_us = sorted((a + b) / 1e3 for a, b, _, _ in samples)
    return {
        "num_running": NUM_RUNNING,
        "num_arriving_per_step": case.num_arriving,
        "enable_prefix_caching": case.enable_prefix_caching,
        "num_rounds": num_rounds,
        "num_warmup_steps_per_round": num_warmup,
        "num_steps": len(samples),
        "median_us": statistics.median(step_us),
        "p90_us": percentile(step_us, 90),
        "mean_us": statistics.fmean(step_us),
        "min_us": step_us[0],
        "max_us": step_us[-1],
        "median_schedule_us": statistics.median(a / 1e3 for a, _, _, _ in samples),
        "median_pickle_us": statistics.median(b / 1e3 for _, b, _, _ in samples),
        "median_bookkeeping_us": statistics.median(c / 1e3 for _, _, c, _ in samples),
        "median_message_bytes": statistics.median(d for _, _, _, d in samples),
        "num_gpu_blocks": num_gpu_blocks,
    }


def python_loop_ns(n: int = 1_000_000) -> float:
    """ns per iteration of an empty Python loop (best of 5): how fast this machine runs
    Python, so figures can be compared across machines (a 2023 desktop: ~10-20 ns)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            pass
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def run(num_rounds: int, num_warmup: int, num_steps: int, seed: int) -> dict:
    cases = {case.name: run_case(case, num_rounds, num_warmup, num_steps, seed) for case in CASES}
    median = cases["decode_256"]["median_us"]
    return {
        "median_us_per_step": median,
        "p90_us_per_step": cases["decode_256"]["p90_us"],
        "target_median_us": TARGET_MEDIAN_US,
        "target_met": median < TARGET_MEDIAN_US,
        "cases": cases,
        "config": {
            "block_size": BLOCK_SIZE,
            "prompt_len_range": [MIN_PROMPT, MAX_PROMPT],
            "seed": seed,
            "timed": "Scheduler.schedule() + pickling the step message (median_us); appending one token "
            "to each scheduled sequence (bookkeeping, beside it)",
            "python_loop_ns_per_iteration": python_loop_ns(),
        },
    }


def format_report(result: dict) -> str:
    header = (
        f"{'case':28s} {'running':>7s} {'arriving':>8s} {'median us':>10s} {'p90 us':>9s} {'min us':>8s} "
        f"{'schedule':>9s} {'pickle':>7s} {'bytes':>7s} {'bookkeep':>9s} {'steps':>6s}"
    )
    lines = [header, "-" * len(header)]
    for name, c in result["cases"].items():
        lines.append(
            f"{name:28s} {c['num_running']:7d} {c['num_arriving_per_step']:8d} {c['median_us']:10.1f} "
            f"{c['p90_us']:9.1f} {c['min_us']:8.1f} {c['median_schedule_us']:9.1f} {c['median_pickle_us']:7.1f} "
            f"{c['median_message_bytes']:7.0f} {c['median_bookkeeping_us']:9.1f} {c['num_steps']:6d}"
        )
    cfg, machine = result["config"], result["machine"]
    verdict = "PASS" if result["target_met"] else "FAIL"
    lines += [
        "(median us = schedule + pickle; schedule / pickle / bookkeep: medians of each part, in us;",
        " bytes: the pickled step message)",
        f"machine: {machine['cpu_count']} CPUs, Python {machine['versions']['python']}, empty Python loop "
        f"{cfg['python_loop_ns_per_iteration']:.1f} ns/iteration, load average {machine['load_average']}",
        "",
        f"[{verdict}] median per step with {NUM_RUNNING} running (decode_256) < "
        f"{result['target_median_us']:.0f} us: {result['median_us_per_step']:.1f} us",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench scheduler", __doc__.splitlines()[0], out_required=True,
                              out_help="directory for scheduler.json", seed=DEFAULT_SEED,
                              quick_help="one short round per case (for tests)")
    parser.add_argument("--rounds", type=int, default=None, help="fresh schedulers per case (default 8)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default 250)")
    args = parser.parse_args(argv)
    num_rounds = args.rounds or (1 if args.quick else 8)
    num_steps = args.steps or (30 if args.quick else 250)
    num_warmup = 5 if args.quick else 50
    if num_steps < 1 or num_rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    result = run(num_rounds, num_warmup, num_steps, args.seed)
    write_report(args.out, "scheduler.json", result, format_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
