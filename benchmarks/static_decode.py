"""The static-shape decode path against the eager one: engine throughput with
enforce_eager off (decode-only steps padded to a bucket; CUDA graphs where captured) and on
(every step on its exact batch), interleaved on the same requests.

    python benchmarks/static_decode.py --out DIR [--rounds 3] [--quick] [--seed 0] [--device cpu|cuda]

The workload is `bench throughput`'s uniform case (benchmarks/throughput.py: random-weight
OPT, 6 layers, hidden 512; prompt and output lengths uniform on 16..256), float32 on CPU
with one torch thread, greedy with ignore_eos. Each round runs both engines once, in
alternating order, after one untimed warm-up call each; the tokens of the two must be
equal. Writes DIR/static_decode.json: per round and mode, wall and CPU seconds and output
tokens/s, and the median ratio static / eager (above 1: the static path is faster).
On CPU the padded rows are extra work and no graph is captured, so this measures what the
static path costs there; on CUDA it measures what the graphs gain.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.options import benchmark_parser  # noqa: E402
from benchmarks.records import write_json  # noqa: E402
from benchmarks.throughput import FULL, QUICK, kv_cache_gb, make_requests, run_engine  # noqa: E402
from rayserve_paged import LLM  # noqa: E402
from rayserve_paged.models.tiny import make_tiny_model  # noqa: E402

MODES = ("static", "eager")


def make_engine(model_dir: str, kv_gb: float, device: str, enforce_eager: bool) -> LLM:
    return LLM(
        model=model_dir, dtype="float32", device=device, num_cpu_threads=1, kv_cache_memory_gb=kv_gb,
        enable_prefix_caching=False, seed=0, enforce_eager=enforce_eager,
    )


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("python benchmarks/static_decode.py", __doc__.splitlines()[0], out_required=True,
                              out_help="directory for static_decode.json",
                              quick_help="the tiny model and a few requests (seconds)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    workload = QUICK if args.quick else FULL
    requests = make_requests(workload, seed=args.seed)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="static-decode-") as tmp:
        model_dir = str(make_tiny_model("opt", os.path.join(tmp, "opt"), **workload.model))
        kv_gb = kv_cache_gb(workload, model_dir)
        engines = {mode: make_engine(model_dir, kv_gb, args.device, mode == "eager") for mode in MODES}
        for llm in engines.values():
            run_engine(llm, requests[:4])  # warm-up
        output_tokens = sum(r.output_len for r in requests)
        for index in range(args.rounds):
            order = MODES if index % 2 == 0 else MODES[::-1]
            row, tokens = {}, {}
            for mode in order:
                timing, tokens[mode] = run_engine(engines[mode], requests)
                row[mode] = {"seconds": timing.seconds, "cpu_seconds": timing.cpu_seconds,
                             "output_tokens_per_s": output_tokens / timing.seconds}
            if tokens["static"] != tokens["eager"]:
                raise SystemExit("the static path's tokens differ from the eager path's")
            row["static_over_eager"] = row["eager"]["seconds"] / row["static"]["seconds"]
            row["static_over_eager_cpu"] = row["eager"]["cpu_seconds"] / row["static"]["cpu_seconds"]
            rounds.append(row)
            print(f"round {index}: static {row['static']['output_tokens_per_s']:.1f} tok/s, eager "
                  f"{row['eager']['output_tokens_per_s']:.1f} tok/s, static/eager {row['static_over_eager']:.3f} "
                  f"(per CPU s {row['static_over_eager_cpu']:.3f})", flush=True)
        static = engines["static"].engine.executor.worker.runner.static_decode
        buckets = list(static.buckets)
        runs = dict(static.runs)
    result = {
        "command": " ".join(["python", "benchmarks/static_decode.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": args.device, "workload": "quick" if args.quick else "uniform", "num_requests": len(requests),
        "output_tokens": output_tokens, "buckets": buckets, "static_runs": runs, "rounds": rounds,
        "median_static_over_eager": statistics.median(r["static_over_eager"] for r in rounds),
        "median_static_over_eager_cpu": statistics.median(r["static_over_eager_cpu"] for r in rounds),
    }
    path = write_json(args.out, "static_decode.json", result)
    print(f"median static / eager: {result['median_static_over_eager']:.3f} wall, "
          f"{result['median_static_over_eager_cpu']:.3f} per CPU second; {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
