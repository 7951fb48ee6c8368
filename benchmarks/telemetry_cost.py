"""What telemetry costs the engine: the same requests with and without it, interleaved.

"On" is what the scheduler actor does in serving: ReplicaTelemetry records every step's
finished outputs (latency histograms, finish reasons) and the metrics are collected and
rendered as Prometheus text once per `--scrape-every` steps (a scrape far more often than a
real Prometheus does). Runs alternate off/on so drifting machine load hits both alike, and throughput is output
tokens per CPU-second of the engine's process (wall time swings with other load).

    rayserve-paged bench telemetry --out DIR [--rounds 3] [--quick]
"""

from __future__ import annotations

import random
import statistics
import time

from benchmarks.options import benchmark_parser
from benchmarks.records import load_average, write_json


def _run(engine, requests, telemetry, scrape_every: int) -> float:
    from rayserve_paged import SamplingParams

    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"r{time.monotonic_ns()}-{i}", None, params, prompt_token_ids=prompt)
    tokens, steps = 0, 0
    start = time.process_time()  # this process's CPU time: steadier than wall time on a shared machine
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        if telemetry is not None:
            telemetry.record_outputs(outputs)
            if steps % scrape_every == 0:
                telemetry.metrics_text()
        tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)  # per-step deltas
    return tokens / (time.process_time() - start)


def main(argv: list[str]) -> int:
    parser = benchmark_parser("rayserve-paged bench telemetry", __doc__, out_required=True,
                              out_help="directory for telemetry.json", quick_help="6 requests, one round (for tests)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--scrape-every", type=int, default=10)
    args = parser.parse_args(argv)
    import torch

    from rayserve_paged.config import EngineConfig
    from rayserve_paged.engine.llm_engine import LLMEngine
    from rayserve_paged.telemetry import ReplicaTelemetry, TelemetryConfig

    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    num = 6 if args.quick else args.num_requests
    rounds = 1 if args.quick else args.rounds
    requests = [([rng.randrange(10, 500) for _ in range(rng.randint(16, 128))], rng.randint(16, 96)) for _ in range(num)]
    engine = LLMEngine(
        EngineConfig(model="tiny-opt", device="cpu", max_model_len=512, kv_cache_memory_gb=0.1, swap_space_gb=0.01)
    )
    telemetry = ReplicaTelemetry(engine, TelemetryConfig(replica="bench"))
    _run(engine, requests[:4], None, args.scrape_every)  # warm-up
    off, on = [], []
    load_before = load_average()
    for _ in range(rounds):
        off.append(_run(engine, requests, None, args.scrape_every))
        on.append(_run(engine, requests, telemetry, args.scrape_every))
    load_after = load_average()
    cost = 1 - statistics.median(on) / statistics.median(off)
    result = {
        "off_output_tokens_per_s": off,
        "on_output_tokens_per_s": on,
        "cost_fraction": cost,
        "target_met": cost < 0.03,
        "config": {"model": "tiny-opt", "num_requests": num, "rounds": rounds, "scrape_every_steps": args.scrape_every},
        "load_average": {"before": load_before, "after": load_after},
    }
    print(f"{'round':>5} {'off tok/CPU-s':>14} {'on tok/CPU-s':>14}")
    for i, (a, b) in enumerate(zip(off, on)):
        print(f"{i:5d} {a:14.1f} {b:14.1f}")
    print(f"telemetry cost (median on vs off): {cost * 100:.1f}%  [{'PASS' if cost < 0.03 else 'FAIL'}] target < 3%")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    write_json(args.out, "telemetry.json", result)
    return 0
