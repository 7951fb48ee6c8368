"""Per-step control overhead of the Ray executor against the in-process executor.

The same requests run through LLMEngine in each mode: in this process (the baseline), in a
Ray actor with rank 0 in that actor's process (the TP=1 Serve path: the SchedulerActor hosts
rank 0), and with worker actors driven by plain actor calls or by the compiled step graph, at
TP=1 and TP=2 (gloo on CPU). For each, the time a step spends outside rank 0's execute()
(scheduling, processing outputs, and for worker actors sending the step message and
returning the samples) is its control overhead.

    rayserve-paged bench ray-overhead --out DIR [--quick] [--max-tp 1|2]
"""

from __future__ import annotations

import os
import random
import statistics
import time

from benchmarks.options import benchmark_parser
from benchmarks.records import write_json


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
    """Rank 0's (steps, seconds inside execute)."""
    if hasattr(executor, "worker"):
        return executor.worker.timing()
    import ray

    return ray.get(executor.workers[0].timing.remote())


def _measure_engine(engine, requests) -> dict:
    _run(engine, requests[:4])  # warm-up
    steps0, exec0 = _worker_timing(engine.executor)
    result = _run(engine, requests)
    steps1, exec1 = _worker_timing(engine.executor)
    result["worker_execute_s"] = exec1 - exec0
    result["overhead_ms_per_step"] = (result["wall_s"] - result["worker_execute_s"]) / result["steps"] * 1e3
    result["worker_ms_per_step"] = result["worker_execute_s"] / result["steps"] * 1e3
    engine.executor.shutdown()
    return result


class EngineHost:
    """An engine in a Ray actor of its own, as the SchedulerActor holds it: `in-process` is
    the TP=1 Serve path (rank 0 in the scheduler's process); `ray` drives worker actors."""

    def __init__(self, config, executor: str, worker_cpus: float) -> None:
        from rayserve_paged.engine.llm_engine import LLMEngine

        if executor == "ray":
            from rayserve_paged.engine.ray_executor import RayExecutor

            self.engine = LLMEngine(config, executor_factory=lambda c, p: RayExecutor(c, p, worker_cpus=worker_cpus))
        else:
            self.engine = LLMEngine(config)

    def measure(self, requests) -> dict:
        return _measure_engine(self.engine, requests)


# name -> (tensor_parallel_size, executor, worker_transport); "driver" runs in this process
MODES = {
    "in_process": (1, "driver", "actor_calls"),
    "tp1_in_scheduler": (1, "in-process", "actor_calls"),
    "tp1_actor_calls": (1, "ray", "actor_calls"),
    "tp1_compiled_graph": (1, "ray", "compiled_graph"),
    "tp2_actor_calls": (2, "ray", "actor_calls"),
    "tp2_compiled_graph": (2, "ray", "compiled_graph"),
}


def measure(mode: str, config, requests, worker_cpus: float) -> dict:
    tp, executor, transport = MODES[mode]
    config = config.model_copy(update={"tensor_parallel_size": tp, "worker_transport": transport})
    if executor == "driver":
        from rayserve_paged.engine.llm_engine import LLMEngine

        return _measure_engine(LLMEngine(config), requests)
    import ray

    host = ray.remote(EngineHost).options(num_cpus=0.1).remote(config, executor, worker_cpus)
    try:
        return ray.get(host.measure.remote(requests))
    finally:
        ray.kill(host)


def main(argv: list[str]) -> int:
    parser = benchmark_parser("rayserve-paged bench ray-overhead", __doc__, out_required=True,
                              out_help="directory for ray_overhead.json", quick_help="6 requests (for tests)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--model", default="tiny-opt")
    parser.add_argument("--max-tp", type=int, default=2, choices=(1, 2), help="largest tensor-parallel size to run")
    parser.add_argument("--worker-cpus", type=float, default=0.5, help="CPUs of each worker actor")
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
    results = {"in_process": measure("in_process", config, requests, args.worker_cpus)}
    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        for mode in MODES:
            if mode != "in_process" and MODES[mode][0] <= args.max_tp:
                results[mode] = measure(mode, config, requests, args.worker_cpus)
    finally:
        ray.shutdown()
    base = results["in_process"]["overhead_ms_per_step"]
    for r in results.values():
        r["extra_overhead_ms_per_step"] = r["overhead_ms_per_step"] - base
    results["config"] = {
        "model": args.model, "num_requests": num, "seed": args.seed, "torch_threads": 1, "worker_cpus": args.worker_cpus
    }  # fmt: skip
    print(f"{'executor':20} {'steps':>6} {'median step ms':>15} {'worker ms/step':>15} {'overhead ms/step':>17} "
          f"{'over in-process':>16}")  # fmt: skip
    for name in MODES:
        if name in results:
            r = results[name]
            print(f"{name:20} {r['steps']:6d} {r['median_step_ms']:15.2f} {r['worker_ms_per_step']:15.2f} "
                  f"{r['overhead_ms_per_step']:17.2f} {r['extra_overhead_ms_per_step']:16.2f}")  # fmt: skip
    write_json(args.out, "ray_overhead.json", results)
    return 0
