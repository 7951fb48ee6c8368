"""TTFT of urgent requests under a flood of less urgent ones: scheduling_policy fcfs
against priority, on the in-process engine (no Serve: what the scheduler does).

    rayserve-paged bench priority --out DIR          (python -m benchmarks.priority)

The default tiny OPT (2 layers, hidden 64) on the CPU, max_num_seqs 16, a KV pool small
enough that the flood preempts. A flood of --flood priority-10 requests (prompts of 64
tokens, 64 output tokens, ignore_eos) is queued at once; then, every --every steps, one
priority-0 request (the same shape) arrives, --urgent in all. TTFT (wall clock, from a
request's add_request to the step that returns its first token) of the priority-0
requests, p50 / p99, per policy; and the flood's own completion time. The same seeded
prompts for both policies; the policies alternate over --rounds rounds.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.records import write_json


def _run(model_dir: str, policy: str, args) -> dict:
    from rayserve_paged.config import EngineConfig
    from rayserve_paged.core.sequence import SamplingParams
    from rayserve_paged.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model_dir, device="cpu", max_model_len=256, max_num_seqs=16,
                                    num_gpu_blocks_override=args.kv_blocks, swap_space_gb=0.01,
                                    scheduling_policy=policy))  # fmt: skip
    rng = random.Random(args.seed)
    prompt = lambda: [rng.randrange(10, 500) for _ in range(64)]  # noqa: E731

    def params(priority: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, priority=priority)

    start = time.perf_counter()
    for i in range(args.flood):
        engine.add_request(f"flood{i}", None, params(10), prompt_token_ids=prompt())
    added: dict[str, float] = {}
    ttft: list[float] = []
    num_urgent = 0
    step = 0
    flood_done = None
    while engine.has_unfinished_requests() or num_urgent < args.urgent:
        if num_urgent < args.urgent and step % args.every == 0:
            request_id = f"urgent{num_urgent}"
            engine.add_request(request_id, None, params(0), prompt_token_ids=prompt())
            added[request_id] = time.perf_counter()
            num_urgent += 1
        for out in engine.step():
            if out.request_id in added and out.outputs and out.outputs[0].token_ids:
                ttft.append(time.perf_counter() - added.pop(out.request_id))
        step += 1
        if flood_done is None and not any(r.startswith("flood") for r in engine.scheduler.groups):
            flood_done = time.perf_counter() - start
    ttft.sort()
    return {
        "policy": policy,
        "urgent_ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
        "urgent_ttft_p99_ms": round(1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
        "flood_done_s": round(flood_done or 0.0, 2),
        "preemptions": engine.scheduler.counters.preemptions_recompute + engine.scheduler.counters.preemptions_swap,
        "steps": step,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayserve-paged bench priority", description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=200)
    parser.add_argument("--urgent", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="steps between urgent arrivals")
    parser.add_argument("--kv-blocks", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from rayserve_paged.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model("opt", os.path.join(tmp, "opt")))
        runs = [_run(model_dir, policy, args) for _ in range(args.rounds) for policy in ("fcfs", "priority")]
    for run in runs:
        print("  ".join(f"{k} {v}" for k, v in run.items()))
    write_json(args.out, "priority.json", {"runs": runs, "args": {k: str(v) for k, v in vars(args).items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
