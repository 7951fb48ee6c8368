"""Mixed load on CPU, in-process: steady decodes while long prompts arrive, with chunked
prefill on and off in one run.

    decodes   `--num-decodes` requests (prompts 16-64 tokens, `--decode-len` output tokens)
              start together and decode throughout
    arrivals  `--num-long` long prompts (`--min-long`..`--max-long` tokens, 8 output tokens)
              arrive one every `--interval` engine steps, from step 4 on

Both runs use the throughput benchmark's small OPT (6 layers, hidden 512, random weights),
greedy, EOS ignored, prefix caching off (random prompts share nothing), one torch thread.
Chunked prefill runs with `max_num_batched_tokens` = `--chunk-budget`; without chunking the
budget is max_model_len (a long prompt is prefilled in one step, stalling the decodes).
Arrivals are counted in engine steps so both runs see the same order of events.

Reported per run, over all requests: TTFT (arrival to first token), TPOT (per request: time
from its first to its last token / (output tokens - 1)) and ITL (every gap between two
consecutive tokens of a request) as mean / p50 / p99, and output tokens per second (all
requests' output tokens / wall seconds of the run).
"""

from __future__ import annotations

import os
import platform
import random
import sys
import tempfile
import time

import torch

from benchmarks.metrics import percentile
from benchmarks.options import benchmark_parser
from benchmarks.records import load_average, write_json
from benchmarks.throughput import FULL
from rayserve_paged import LLM, SamplingParams
from rayserve_paged.models.tiny import SPECIAL_TOKENS, TINY_VOCAB_SIZE, make_tiny_model

FIRST_ARRIVAL_STEP = 4
LONG_OUTPUT_LEN = 8


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}


def make_workload(args) -> tuple[list[tuple[list[int], int]], list[tuple[list[int], int]]]:
    rng = random.Random(f"mixed-{args.seed}")
    first = len(SPECIAL_TOKENS)

    def prompt(n):
        return [rng.randrange(first, TINY_VOCAB_SIZE) for _ in range(n)]

    decodes = [(prompt(rng.randint(16, 64)), args.decode_len) for _ in range(args.num_decodes)]
    longs = [(prompt(rng.randint(args.min_long, args.max_long)), LONG_OUTPUT_LEN) for _ in range(args.num_long)]
    return decodes, longs


def run_once(model_dir: str, args, chunked: bool, decodes, longs) -> dict:
    max_model_len = 2048
    llm = LLM(
        model=model_dir,
        dtype="float32",
        device="cpu",
        num_cpu_threads=1,
        kv_cache_memory_gb=0.5,
        enable_prefix_caching=False,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        max_num_seqs=min(32, args.chunk_budget),
        max_num_batched_tokens=args.chunk_budget if chunked else max_model_len,
        seed=args.seed,
    )
    engine = llm.engine
    # warm-up: one short request through the whole path, untimed
    llm.generate(prompt_token_ids=[decodes[0][0]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    arrival: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    pending = list(enumerate(longs))
    start = time.perf_counter()
    for i, (ids, n) in enumerate(decodes):
        rid = f"decode-{i}"
        engine.add_request(rid, None, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), prompt_token_ids=ids)
        arrival[rid] = start
        token_times[rid] = []
    step = 0
    while engine.has_unfinished_requests() or pending:
        if pending and step >= FIRST_ARRIVAL_STEP + pending[0][0] * args.interval:
            j, (ids, n) = pending.pop(0)
            rid = f"long-{j}"
            engine.add_request(rid, None, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), prompt_token_ids=ids)
            arrival[rid] = time.perf_counter()
            token_times[rid] = []
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:  # per-step deltas: the tokens each request gained this step
            for delta in o.outputs:
                token_times[o.request_id].extend([now] * len(delta.token_ids))
        step += 1
    seconds = time.perf_counter() - start
    ttft = [token_times[r][0] - arrival[r] for r in token_times]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values() if len(t) > 1]
    itl = [b - a for t in token_times.values() for a, b in zip(t, t[1:])]
    decode_itl = [b - a for r, t in token_times.items() if r.startswith("decode") for a, b in zip(t, t[1:])]
    num_tokens = sum(len(t) for t in token_times.values())
    return {
        "chunked_prefill": chunked,
        "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
        "steps": step,
        "seconds": seconds,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / seconds,
        "ttft_s": _summary(ttft),
        "tpot_s": _summary(tpot),
        "itl_s": _summary(itl),
        "decode_itl_s": _summary(decode_itl),
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench mixed", __doc__.split("\n\n")[0], out_default="bench-out",
                              out_help="directory for mixed.json",
                              quick_help="the default tiny OPT and a few short requests (tests)")
    parser.add_argument("--num-decodes", type=int, default=8)
    parser.add_argument("--decode-len", type=int, default=96)
    parser.add_argument("--num-long", type=int, default=3)
    parser.add_argument("--min-long", type=int, default=1024)
    parser.add_argument("--max-long", type=int, default=2000)
    parser.add_argument("--interval", type=int, default=24, help="engine steps between long arrivals")
    parser.add_argument("--chunk-budget", type=int, default=512)
    args = parser.parse_args(argv)
    model = FULL.model
    if args.quick:
        model = {}
        args.num_decodes, args.decode_len, args.num_long = 2, 6, 1
        args.min_long, args.max_long, args.interval, args.chunk_budget = 60, 80, 2, 32
    torch.set_num_threads(1)
    decodes, longs = make_workload(args)
    loadavg = {"start": load_average()}
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-mixed-") as tmp:
        model_dir = str(make_tiny_model("opt", os.path.join(tmp, "opt"), **model))
        for chunked in (True, False):
            runs.append(run_once(model_dir, args, chunked, decodes, longs))
            loadavg[f"after_{'chunked' if chunked else 'unchunked'}"] = load_average()
    print(f"{'chunked':>8} {'budget':>6} {'tok/s':>7} | {'TTFT mean':>9} {'p50':>7} {'p99':>7} | "
          f"{'TPOT mean':>9} {'p50':>7} {'p99':>7} | {'ITL p50':>7} {'p99':>7} | {'decode ITL p99':>14}  (ms)")
    for r in runs:
        ms = lambda d, k: 1000 * r[d][k]  # noqa: E731
        print(
            f"{str(r['chunked_prefill']):>8} {r['max_num_batched_tokens']:>6} {r['output_tokens_per_s']:7.1f} | "
            f"{ms('ttft_s', 'mean'):9.1f} {ms('ttft_s', 'p50'):7.1f} {ms('ttft_s', 'p99'):7.1f} | "
            f"{ms('tpot_s', 'mean'):9.1f} {ms('tpot_s', 'p50'):7.1f} {ms('tpot_s', 'p99'):7.1f} | "
            f"{ms('itl_s', 'p50'):7.1f} {ms('itl_s', 'p99'):7.1f} | {ms('decode_itl_s', 'p99'):14.1f}"
        )
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, load average {loadavg}")
    path = write_json(args.out, "mixed.json", {"args": vars(args), "runs": runs, "loadavg": loadavg})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
