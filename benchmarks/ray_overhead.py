"""Per-step control overhead of the Ray executor against the in-process executor.

The same requests run through LLMEngine twice: with the worker in the engine's process, and
with the worker as a Ray actor (the Serve path). For each, the time a step spends outside
the worker's execute() (scheduling, processing outputs, and for Ray the broadcast of the
SchedulerOutput and the return of the samples) is its control overhead.

    rayserve-paged bench ray-overhead --out DIR [--tp 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path


def _requests(num: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, 500) for _ in range(rng.randint(16, 128))], rng.randint(16, 96)) for _ in range(num)]


def _run(engine, requests) -> dict:
    from rayserve_paged import SamplingParams

    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    step_times = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    return {"steps": len(step_times), "wall_s": wall, "median_step_ms": statistics.median(step_times) * 1e3}


def _worker_timing(executor) -> tuple[int, float]:
    if hasattr(executor, "worker"):
        return executor.worker.timing()
    import ray

    return ray.get(executor.workers[0].timing.remote())


def measure(executor_name: str, config, requests) -> dict:
    from rayserve_paged.engine.llm_engine import LLMEngine

    if executor_name == "ray":
        from rayserve_paged.engine.ray_executor import RayExecutor

        engine = LLMEngine(config, executor_factory=lambda c, p: RayExecutor(c, p, worker_cpus=1.0))
    else:
        engine = LLMEngine(config)
    _run(engine, requests[:4])  # warm-up
    steps0, exec0 = _worker_timing(engine.executor)
    result = _run(engine, requests)
    steps1, exec1 = _worker_timing(engine.executor)
    result["worker_execute_s"] = exec1 - exec0
    result["overhead_ms_per_step"] = (result["wall_s"] - result["worker_execute_s"]) / result["steps"] * 1e3
    result["worker_ms_per_step"] = result["worker_execute_s"] / result["steps"] * 1e3
    engine.executor.shutdown()
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rayserve-paged bench ray-overhead", description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--model", default="tiny-opt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import torch

    from rayserve_paged.config import EngineConfig

    torch.set_num_threads(1)
    num = 6 if args.quick else args.num_requests
    requests = _requests(num, args.seed)
    config = EngineConfig(
        model=args.model, device="cpu", max_model_len=512, kv_cache_memory_gb=0.1, swap_space_gb=0.01, num_cpu_threads=1
    )
    results = {"in_process": measure("in_process", config, requests)}
    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        results["ray"] = measure("ray", config, requests)
    finally:
        ray.shutdown()
    results["extra_overhead_ms_per_step"] = (
        results["ray"]["overhead_ms_per_step"] - results["in_process"]["overhead_ms_per_step"]
    )
    results["config"] = {"model": args.model, "num_requests": num, "seed": args.seed, "torch_threads": 1}
    print(f"{'executor':12} {'steps':>6} {'median step ms':>15} {'worker ms/step':>15} {'overhead ms/step':>17}")
    for name in ("in_process", "ray"):
        r = results[name]
        print(
            f"{name:12} {r['steps']:6d} {r['median_step_ms']:15.2f} {r['worker_ms_per_step']:15.2f} "
            f"{r['overhead_ms_per_step']:17.2f}"
        )
    print(f"Ray executor adds {results['extra_overhead_ms_per_step']:.2f} ms of control overhead per step")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray_overhead.json").write_text(json.dumps(results, indent=2))
    return 0
