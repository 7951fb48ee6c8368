"""KV blocks saved by sharing within a request: parallel sampling and beam search (the
paper's Figure 15), measured through the real engine.

Each case serves its requests (all submitted at once) through one engine and counts blocks
two ways at every step, right after scheduling (the state the model computes on: copy-on-write
done, every running sequence has a slot for its new token):

    with sharing       GPU blocks in use, `BlockManager.usage().gpu_used` (forked
                       sequences hold the blocks they share once)
    without sharing    sum over the scheduled sequences of len(block table)
                       (= ceil(len / block_size): what each would hold alone)

    saved_fraction = 1 - sum over steps (with sharing) / sum over steps (without sharing)

Prefix caching is off, so the only sharing is fork / copy-on-write inside a request.
Chunked prefill is off too: a prompt is prefilled in one step, as in the paper. (With chunks,
each prefill chunk step would add the whole prompt's blocks, allocated at admission, to both
sums alike, by an amount that depends on which prompts share a step's token budget: the
figure would depend on the schedule. Decoding, where the sharing is, is the same either way.)
Nothing is ever preempted (the pool holds every sequence at once; checked), so each
request contributes the same block-steps whatever else shares its batches: the figure
depends on the length mix and the sharing, not on the schedule.

Workload: prompt and output lengths from the ShareGPT / Alpaca length distributions of
benchmarks.memory (log-normal with the paper's means), outputs capped at
--max-output-len (the cap raises the saving: prompts weigh more against shorter outputs;
the report shows parallel sampling's value for the uncapped distribution beside it);
prompts are random token ids; every request ignores EOS and stops at
its drawn output length. Parallel sampling: temperature 1, top_p 1, a seed per request
(with random weights the samples diverge at once, so they share the prompt's full blocks
and nothing after). Beam search: width W, temperature 0, length penalty 1.

Model: a tiny random-weight OPT (1 layer, hidden 16, 1 head, ffn 32, vocab 512,
max_position_embeddings 2048), block size 16: the cost of a step is Python per sequence,
not the model, and block accounting does not depend on the model's size. Parallel
sampling's saving follows from the lengths alone (see `expected_parallel_saving`); the run
checks the engine reproduces it exactly. Beam search's depends on how the beams branch,
which with random weights need not match a trained model's (the default tiny OPT, 2 layers
and hidden 64, gave beam savings within 2 points of this one on a smaller sample).
"""

from __future__ import annotations

import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from benchmarks.memory import DATASETS, MAX_SEQ_LEN, Request, sample_requests
from benchmarks.options import benchmark_parser
from benchmarks.records import progress, write_report
from rayserve_paged import LLM, SamplingParams
from rayserve_paged.core.outputs import SchedulerOutput
from rayserve_paged.models.tiny import SPECIAL_TOKENS, TINY_VOCAB_SIZE, make_tiny_model

BLOCK_SIZE = 16
MAX_NUM_SEQS = 256
DEFAULT_SEED = 0
DEFAULT_NUM_REQUESTS = {"sharegpt": 60, "alpaca": 300}
# Enough ShareGPT prompts that several share one step's token budget (the schedule a full run
# has), still seconds.
QUICK_NUM_REQUESTS = {"sharegpt": 16, "alpaca": 12}
DEFAULT_MAX_OUTPUT_LEN = 1024
QUICK_MAX_OUTPUT_LEN = 32
# Parallel sampling's expectation needs no model: evaluate it on many more requests to show
# how far the measured sample sits from its distribution's value, with and without the cap.
NUM_POPULATION_REQUESTS = 20_000

# 1 layer, hidden 16: big enough to give varied logits, small enough that a step is Python.
MODEL_OVERRIDES = {
    "hidden_size": 16,
    "word_embed_proj_dim": 16,
    "num_attention_heads": 1,
    "ffn_dim": 32,
    "num_hidden_layers": 1,
    "max_position_embeddings": MAX_SEQ_LEN,
}

# The paper's Section 6.3 / Figure 15: KV memory saved, over n (or width) = 2, 4, 6.
PAPER_SAVED = {
    ("alpaca", "parallel"): (0.061, 0.098),
    ("sharegpt", "parallel"): (0.162, 0.305),
    ("alpaca", "beam"): (0.376, 0.552),
    ("sharegpt", "beam"): (0.443, 0.663),
}


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    kind: str  # "parallel" | "beam"
    width: int  # n for parallel sampling, beam width for beam search

    def params(self, max_tokens: int, seed: int) -> SamplingParams:
        if self.kind == "beam":
            return SamplingParams(
                n=self.width, use_beam_search=True, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
            )
        return SamplingParams(
            n=self.width, temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed
        )


CASES = [Case(f"parallel_n{w}", "parallel", w) for w in (2, 4, 6)] + [Case(f"beam_w{w}", "beam", w) for w in (2, 4, 6)]


# ---------------------------------------------------------------------------- workload


def make_requests(dataset: str, num_requests: int, seed: int, max_output_len: int) -> list[Request]:
    """benchmarks.memory's lengths (prompt + output <= 2048), outputs capped at max_output_len."""
    requests = sample_requests(DATASETS[dataset], num_requests, seed)
    return [Request(r.index, r.prompt_len, min(r.output_len, max_output_len)) for r in requests]


def make_prompts(requests: list[Request], seed: int, dataset: str) -> list[list[int]]:
    """Random ids of ordinary (non-special) tokens, distinct per request."""
    rng = random.Random(f"{dataset}-prompts-{seed}")
    first = len(SPECIAL_TOKENS)
    return [[rng.randrange(first, TINY_VOCAB_SIZE) for _ in range(r.prompt_len)] for r in requests]


def expected_parallel_saving(requests: list[Request], n: int, block_size: int) -> float:
    """What the meter must read for parallel sampling with samples that never agree.

    Step 1 prefills the prompt alone (P tokens, ceil(P / bs) blocks, nothing shared). The
    n samples then fork; at step k >= 2 each holds L = P + k - 1 tokens: the prompt's
    floor(P / bs) full blocks are shared, the rest (including a copied partial prompt
    block) are private. The request ends after step O (its O-th token is never computed).
    """
    with_sharing = without_sharing = 0
    for r in requests:
        p_blocks = -(-r.prompt_len // block_size)
        full = r.prompt_len // block_size
        num_decode_steps = r.output_len - 1
        # sum of ceil(L / bs) over L = P + 1 .. P + O - 1
        blocks = _sum_ceil(r.prompt_len + r.output_len - 1, block_size) - _sum_ceil(r.prompt_len, block_size)
        with_sharing += p_blocks + full * num_decode_steps + n * (blocks - full * num_decode_steps)
        without_sharing += p_blocks + n * blocks
    return 1 - with_sharing / without_sharing


def _sum_ceil(x: int, block_size: int) -> int:
    """sum of ceil(L / block_size) for L = 1 .. x."""
    q, r = divmod(x, block_size)
    return block_size * q * (q + 1) // 2 + r * (q + 1)


def length_stats(requests: list[Request]) -> dict[str, float]:
    n = len(requests)
    return {
        "num_requests": n,
        "mean_prompt_len": sum(r.prompt_len for r in requests) / n,
        "mean_output_len": sum(r.output_len for r in requests) / n,
        "max_prompt_len": max(r.prompt_len for r in requests),
        "max_output_len": max(r.output_len for r in requests),
    }


# ---------------------------------------------------------------------------- measurement


class BlockMeter:
    """Counts blocks after every `schedule()` of an engine (wraps the scheduler's method
    on that one instance; the engine itself is unchanged).

    Per request too: with prefix caching off no block is shared across requests, so a
    request's blocks in use are the distinct ids in its sequences' tables, and these sum
    to `gpu_used` (checked). Per-request totals give the saving's standard error.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.block_manager = engine.block_manager
        self.block_size = self.block_manager.block_size
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._measure
        self.reset()

    def reset(self) -> None:
        self.num_steps = 0
        self.block_steps_shared = 0  # sum of gpu_used
        self.block_steps_unshared = 0  # sum of per-sequence table lengths
        self.per_request: dict[str, list[int]] = {}  # request id -> [shared, unshared] block-steps
        self.seq_steps = 0
        self.peak_used = 0
        self.peak_unshared = 0
        # consistency checks; all must stay 0
        self.num_unaccounted = 0  # block-steps in use held by no scheduled request (a leak)
        self.num_unscheduled_tables = 0  # table-steps of sequences not scheduled
        self.num_table_mismatches = 0  # tables whose length != ceil(len / block_size)

    def close(self) -> None:
        self.engine.scheduler.schedule = self._schedule

    def _measure(self) -> SchedulerOutput:
        out = self._schedule()
        if not out.scheduled:
            return out
        bm = self.block_manager
        tables = bm.gpu_tables
        bs = self.block_size
        msg = out.message
        used = bm.usage().gpu_used
        step_shared = step_unshared = num_seqs = 0
        for group, first_row, num_rows, _, _ in out.scheduled:
            group_blocks: set[int] = set()
            group_unshared = 0
            rows = range(first_row, first_row + num_rows)
            for row in rows:
                table = tables[msg.seq_ids[row]]
                group_blocks.update(table)
                group_unshared += len(table)
                if len(table) != -(-(msg.start_positions[row] + msg.num_query_tokens[row]) // bs):
                    self.num_table_mismatches += 1
            totals = self.per_request.setdefault(group.request_id, [0, 0])
            totals[0] += len(group_blocks)
            totals[1] += group_unshared
            step_shared += len(group_blocks)
            step_unshared += group_unshared
            num_seqs += len(rows)
        self.num_unaccounted += used - step_shared
        self.num_unscheduled_tables += len(tables) - num_seqs
        self.num_steps += 1
        self.seq_steps += num_seqs
        self.block_steps_shared += used
        self.block_steps_unshared += step_unshared
        self.peak_used = max(self.peak_used, used)
        self.peak_unshared = max(self.peak_unshared, step_unshared)
        return out

    @property
    def saved_fraction(self) -> float:
        return 1 - self.block_steps_shared / self.block_steps_unshared

    def standard_error(self) -> float:
        """Of saved_fraction over requests (the ratio estimator's: requests are the samples)."""
        totals = list(self.per_request.values())
        n = len(totals)
        if n < 2:
            return float("nan")
        ratio = sum(t[0] for t in totals) / sum(t[1] for t in totals)
        mean_unshared = sum(t[1] for t in totals) / n
        residual = sum((t[0] - ratio * t[1]) ** 2 for t in totals) / (n - 1)
        return math.sqrt(residual / n) / mean_unshared


def run_case(
    llm: LLM, meter: BlockMeter, case: Case, requests: list[Request], prompts: list[list[int]], seed: int
) -> dict:
    engine = llm.engine
    counters = engine.scheduler.counters
    preemptions_before = counters.preemptions_recompute + counters.preemptions_swap
    cow_before = engine.block_manager.counters.copy_on_write_blocks
    params = [case.params(r.output_len, seed * 1_000_003 + r.index) for r in requests]
    meter.reset()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    for r, out in zip(requests, outputs):  # every request ran to its exact length
        assert len(out.outputs) == case.width, (case.name, r.index, len(out.outputs))
        assert all(len(c.token_ids) == r.output_len for c in out.outputs), (case.name, r.index)
    figures = {
        "saved_fraction": meter.saved_fraction,
        "standard_error": meter.standard_error(),
        "block_steps_with_sharing": meter.block_steps_shared,
        "block_steps_without_sharing": meter.block_steps_unshared,
        "mean_blocks_with_sharing": meter.block_steps_shared / meter.num_steps,
        "mean_blocks_without_sharing": meter.block_steps_unshared / meter.num_steps,
        "peak_blocks_with_sharing": meter.peak_used,
        "peak_blocks_without_sharing": meter.peak_unshared,
        "num_steps": meter.num_steps,
        "mean_running_seqs": meter.seq_steps / meter.num_steps,
        "copy_on_write_blocks": engine.block_manager.counters.copy_on_write_blocks - cow_before,
        "num_preemptions": counters.preemptions_recompute + counters.preemptions_swap - preemptions_before,
        "gpu_blocks_used_after": engine.block_manager.usage().gpu_used,
        "unaccounted_block_steps": meter.num_unaccounted,
        "unscheduled_table_steps": meter.num_unscheduled_tables,
        "table_length_mismatches": meter.num_table_mismatches,
        "seconds": seconds,
    }
    if case.kind == "parallel":
        figures["expected_saved_fraction"] = expected_parallel_saving(requests, case.width, BLOCK_SIZE)
    return figures


def population_parallel_saving(dataset: str, n: int, seed: int, max_output_len: int) -> float:
    requests = make_requests(dataset, NUM_POPULATION_REQUESTS, seed + 1, max_output_len)
    return expected_parallel_saving(requests, n, BLOCK_SIZE)


def check_consistency(name: str, figures: dict) -> list[str]:
    problems = []
    for key in ("num_preemptions", "gpu_blocks_used_after", "unaccounted_block_steps",
                "unscheduled_table_steps", "table_length_mismatches"):
        if figures[key]:
            problems.append(f"{name}: {key} = {figures[key]} (expected 0)")
    if "expected_saved_fraction" in figures and not math.isclose(
        figures["saved_fraction"], figures["expected_saved_fraction"], rel_tol=1e-12, abs_tol=1e-12
    ):
        problems.append(
            f"{name}: measured {figures['saved_fraction']:.6f} != expected {figures['expected_saved_fraction']:.6f}"
        )
    return problems


# ---------------------------------------------------------------------------- the run


def num_gpu_blocks(num_requests: dict[str, int], max_width: int) -> int:
    """Enough that nothing is preempted: every sequence the batch can hold at full length."""
    per_seq = -(-MAX_SEQ_LEN // BLOCK_SIZE)
    largest_batch = min(MAX_NUM_SEQS, max_width * max(num_requests.values()))
    return largest_batch * per_seq + 64


def run(num_requests: dict[str, int], max_output_len: int, seed: int, quick: bool,
        num_threads: int, log: Callable[[str], None] = print) -> dict:
    max_width = max(c.width for c in CASES)
    engine_options = {
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": False,
        "num_gpu_blocks_override": num_gpu_blocks(num_requests, max_width),
        "swap_space_gb": 0.0,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_model_len": MAX_SEQ_LEN,
        "enable_chunked_prefill": False,  # one prefill step per prompt (see the docstring)
        "preemption_mode": "recompute",
        "dtype": "float32",
        "device": "cpu",
        "num_cpu_threads": num_threads,
        "seed": seed,
    }
    result: dict = {
        "config": {
            "model": {"arch": "opt", **MODEL_OVERRIDES, "vocab_size": TINY_VOCAB_SIZE, "weights": "random (seed 0)"},
            "engine": engine_options,
            "num_requests": num_requests,
            "max_output_len": max_output_len,
            "length_distribution": "benchmarks.memory: lognormal with the paper's means, "
            "prompt + output <= 2048, output then capped at max_output_len",
            "datasets": {name: asdict(DATASETS[name]) for name in num_requests},
            "num_population_requests": NUM_POPULATION_REQUESTS,
            "measured": "after every schedule(): with = usage().gpu_used, "
            "without = sum of scheduled sequences' block-table lengths",
            "parallel_sampling": "temperature 1, top_p 1, seed per request, ignore_eos",
            "beam_search": "temperature 0, length_penalty 1, early_stopping False, ignore_eos",
        },
        "seed": seed,
        "quick": quick,
        "paper": {f"{d}_{k}": list(v) for (d, k), v in PAPER_SAVED.items()},
    }
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-sharing-") as tmp:
        model_dir = make_tiny_model("opt", os.path.join(tmp, "opt"), **MODEL_OVERRIDES)
        llm = LLM(model=str(model_dir), **engine_options)
        meter = BlockMeter(llm.engine)
        for dataset, count in num_requests.items():
            requests = make_requests(dataset, count, seed, max_output_len)
            prompts = make_prompts(requests, seed, dataset)
            per_case: dict = {"workload": length_stats(requests)}
            for case in CASES:
                figures = run_case(llm, meter, case, requests, prompts, seed)
                if case.kind == "parallel":
                    figures["population_saved_fraction"] = population_parallel_saving(
                        dataset, case.width, seed, max_output_len
                    )
                    figures["population_saved_fraction_uncapped"] = population_parallel_saving(
                        dataset, case.width, seed, MAX_SEQ_LEN
                    )
                problems += check_consistency(f"{dataset}/{case.name}", figures)
                per_case[case.name] = figures
                log(f"  {dataset:9s} {case.name:12s} saved {figures['saved_fraction']:6.1%} "
                    f"in {figures['seconds']:.1f} s")
            result[dataset] = per_case
        meter.close()
    result["consistency_problems"] = problems
    result["versus_paper"] = compare_with_paper(result, list(num_requests))
    return result


def compare_with_paper(result: dict, datasets: list[str]) -> list[dict]:
    """Our range over widths 2, 4, 6 against the paper's, end by end."""
    rows = []
    for dataset in datasets:
        for kind in ("parallel", "beam"):
            ours = [result[dataset][c.name]["saved_fraction"] for c in CASES if c.kind == kind]
            low, high = PAPER_SAVED[(dataset, kind)]
            rows.append({
                "dataset": dataset,
                "kind": kind,
                "ours": [min(ours), max(ours)],
                "paper": [low, high],
                "lowest_reaches_paper_lowest": min(ours) >= low,
                "highest_reaches_paper_highest": max(ours) >= high,
                "reached": min(ours) >= low and max(ours) >= high,
            })
    return rows


def format_report(result: dict) -> str:
    cfg = result["config"]
    model = cfg["model"]
    lines = [
        f"tiny OPT ({model['num_hidden_layers']} layer, hidden {model['hidden_size']}, vocab {model['vocab_size']}, "
        f"random weights), block size {cfg['engine']['block_size']}, prefix caching and chunked prefill off, "
        f"{cfg['engine']['num_gpu_blocks_override']} blocks (no preemption), "
        f"max_num_seqs {cfg['engine']['max_num_seqs']}, "
        f"seed {result['seed']}; outputs capped at {cfg['max_output_len']} tokens, ignore_eos",
        "saved = 1 - sum over steps of blocks in use / sum over steps of blocks needed without sharing "
        "(both taken after scheduling)",
        "",
    ]
    header = (
        f"{'dataset':9s} {'case':12s} {'saved':>6s} {'+-se':>5s} | {'expect':>6s} {'pop':>6s} {'uncap':>6s} | "
        f"{'blocks':>7s} {'unshared':>8s} {'peak':>5s} {'unshrd':>6s} | "
        f"{'seqs':>5s} {'steps':>5s} {'CoW':>6s} {'secs':>5s}"
    )
    lines += [
        "saved +- se: measured, with its standard error over requests; expect: parallel sampling's value from the",
        f"lengths alone for these requests; pop / uncap: the same for {NUM_POPULATION_REQUESTS} requests of the "
        "distribution, capped / uncapped",
        "blocks / unshared: mean over steps, with / without sharing; peak: the largest step; seqs: mean running",
        "",
        header,
        "-" * len(header),
    ]

    def pct(figures: dict, key: str) -> str:
        return f"{figures[key]:6.1%}" if key in figures else f"{'-':>6s}"

    for dataset in DATASETS:
        if dataset not in result:
            continue
        w = result[dataset]["workload"]
        for case in CASES:
            f = result[dataset][case.name]
            lines.append(
                f"{dataset:9s} {case.name:12s} {f['saved_fraction']:6.1%} {f['standard_error']:5.1%} | "
                f"{pct(f, 'expected_saved_fraction')} {pct(f, 'population_saved_fraction')} "
                f"{pct(f, 'population_saved_fraction_uncapped')} | "
                f"{f['mean_blocks_with_sharing']:7.1f} {f['mean_blocks_without_sharing']:8.1f} "
                f"{f['peak_blocks_with_sharing']:5d} {f['peak_blocks_without_sharing']:6d} | "
                f"{f['mean_running_seqs']:5.1f} {f['num_steps']:5d} {f['copy_on_write_blocks']:6d} {f['seconds']:5.1f}"
            )
        lines.append(
            f"{'':9s} ({dataset}: {w['num_requests']} requests; mean prompt {w['mean_prompt_len']:.1f}, "
            f"mean output {w['mean_output_len']:.1f} after the cap; max {w['max_prompt_len']} / {w['max_output_len']})"
        )
    lines += ["", "versus the paper (range over n or width = 2, 4, 6):"]
    for row in result["versus_paper"]:
        lines.append(
            f"  {row['dataset']:9s} {row['kind']:9s} ours {row['ours'][0]:6.1%} - {row['ours'][1]:6.1%}   "
            f"paper {row['paper'][0]:6.1%} - {row['paper'][1]:6.1%}   "
            f"lowest >= paper's: {'yes' if row['lowest_reaches_paper_lowest'] else 'NO'}, "
            f"highest >= paper's: {'yes' if row['highest_reaches_paper_highest'] else 'NO'}"
        )
    lines.append("")
    if result["consistency_problems"]:
        lines.append("consistency checks FAILED:")
        lines += [f"  {p}" for p in result["consistency_problems"]]
    else:
        lines.append("consistency checks passed: no preemption, no leaked or unaccounted blocks, "
                     "parallel sampling equals the length-only expectation exactly")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench sharing", __doc__.splitlines()[0], out_required=True,
                              out_help="directory for sharing.json", seed=DEFAULT_SEED)
    parser.add_argument("--sharegpt-requests", type=int, default=None,
                        help=f"default {DEFAULT_NUM_REQUESTS['sharegpt']} "
                        f"({QUICK_NUM_REQUESTS['sharegpt']} with --quick)")
    parser.add_argument("--alpaca-requests", type=int, default=None,
                        help=f"default {DEFAULT_NUM_REQUESTS['alpaca']} ({QUICK_NUM_REQUESTS['alpaca']} with --quick)")
    parser.add_argument("--max-output-len", type=int, default=None,
                        help=f"cap on drawn output lengths (default {DEFAULT_MAX_OUTPUT_LEN}, "
                        f"{QUICK_MAX_OUTPUT_LEN} with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    defaults = QUICK_NUM_REQUESTS if args.quick else DEFAULT_NUM_REQUESTS
    num_requests = {
        "sharegpt": args.sharegpt_requests or defaults["sharegpt"],
        "alpaca": args.alpaca_requests or defaults["alpaca"],
    }
    max_output_len = args.max_output_len or (QUICK_MAX_OUTPUT_LEN if args.quick else DEFAULT_MAX_OUTPUT_LEN)
    if min(num_requests.values()) < 1 or max_output_len < 1:
        parser.error("request counts and --max-output-len must be >= 1")
    result = run(num_requests, max_output_len, args.seed, args.quick, args.threads, log=progress)
    write_report(args.out, "sharing.json", result, format_report)
    return 0 if not result["consistency_problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
