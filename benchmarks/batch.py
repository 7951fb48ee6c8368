"""Batch inference on Ray Data against LLM.generate in one process: rows/s and output
tokens/s on SmolLM2-135M-Instruct chat lines, and how long each engine actor sat idle.

    rayserve-paged bench batch --out DIR [--num-lines 2000] [--max-tokens 32] [--runs llm,1,2]
                               [--rounds 1]

llm      LLM("smollm2").chat over every line's conversation at once (one process, one torch
         thread), timed after the model is loaded and one untimed warm-up call.
batch-N  `run_batch_file` (what `rayserve-paged batch` runs) on the same lines as an OpenAI
         batch file, N engine actors of one torch thread each, in a local Ray instance of
         its own. `wall_s` is the whole job (Ray start, actor start-up and model loads
         included); `engine_s` the longest engine's span from its first step's start to its
         last step's end, the figure that compares with `llm`; `idle_s` per actor: time its
         engine had nothing to step after its first step.

Lines: greedy, exactly max_tokens output tokens each (ignore_eos), distinct questions. With
--rounds N the sequence (llm, batch-1, batch-2, ...) runs N times (the machine is shared:
the interleaving shows how much its load moved).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.options import benchmark_parser
from benchmarks.records import load_average, write_report
from benchmarks.smollm2 import questions

ENGINE = {"model": "smollm2", "device": "cpu", "max_model_len": 512, "kv_cache_memory_gb": 0.25,
          "swap_space_gb": 0.1, "max_num_seqs": 32, "num_cpu_threads": 1}  # fmt: skip


def _lines(num: int, max_tokens: int) -> list[str]:
    return [
        json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True}})  # fmt: skip
        for i, q in enumerate(questions(num))
    ]


def run_llm(num: int, max_tokens: int) -> dict:
    from rayserve_paged import LLM, SamplingParams

    llm = LLM(**ENGINE)
    conversations = [[{"role": "user", "content": q}] for q in questions(num)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(conversations[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up, untimed
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"name": "llm", "rows": num, "output_tokens": tokens, "engine_s": wall,
            "rows_per_s": num / wall, "tokens_per_s": tokens / wall}  # fmt: skip


def run_batch(num: int, max_tokens: int, actors: int, out: Path) -> dict:
    import ray

    from rayserve_paged.batch import BatchConfig
    from rayserve_paged.batch.job import run_batch_file
    from rayserve_paged.config import EngineConfig
    from rayserve_paged.deployments.serving.batch_routes import OpenAIBatchRoutes

    source, output = out / "batch-in.jsonl", out / f"batch-out-{actors}.jsonl"
    source.write_text("\n".join(_lines(num, max_tokens)) + "\n")
    output.unlink(missing_ok=True)
    config = BatchConfig(engine=EngineConfig(**ENGINE), concurrency=actors, worker_cpus=0.5, cpu_stage_cpus=0.1)
    start = time.perf_counter()
    try:
        summary = run_batch_file(source, output, config, OpenAIBatchRoutes, address="local", progress=False)
    finally:
        ray.shutdown()
    wall = time.perf_counter() - start
    engine_s = max(s.span_s for s in summary.replicas.values())
    return {
        "name": f"batch-{actors}", "rows": summary.num_written, "errors": summary.num_errors,
        "output_tokens": summary.num_output_tokens, "wall_s": wall, "engine_s": engine_s,
        "rows_per_s": summary.num_written / engine_s, "tokens_per_s": summary.num_output_tokens / engine_s,
        "wall_rows_per_s": summary.num_written / wall,
        "actors": {name: {"steps": s.num_steps, "busy_s": s.busy_s, "idle_s": s.idle_s, "span_s": s.span_s}
                   for name, s in summary.replicas.items()},
    }  # fmt: skip


def format_report(record: dict) -> str:
    lines = [f"{record['num_lines']} lines x {record['max_tokens']} tokens; load average {record['load_average']}",
             f"{'run':<9} {'rows/s':>8} {'tok/s':>8} {'engine s':>9} {'wall s':>8}  idle s per actor"]  # fmt: skip
    for run in record["runs"]:
        idle = ", ".join(f"{a['idle_s']:.1f}" for a in run.get("actors", {}).values())
        wall = f"{run['wall_s']:8.1f}" if "wall_s" in run else f"{'':8}"
        lines.append(f"{run['name']:<9} {run['rows_per_s']:8.2f} {run['tokens_per_s']:8.1f} {run['engine_s']:9.1f} "
                     f"{wall}  {idle}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench batch", __doc__, out_help="directory for batch.json",
                              out_default="bench-out", seed=None)  # fmt: skip
    parser.add_argument("--num-lines", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", default="llm,1,2", help="comma-separated: llm, and engine actor counts")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    num, max_tokens = (16, 8) if args.quick else (args.num_lines, args.max_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for _ in range(args.rounds):
        for name in args.runs.split(","):
            runs.append(run_llm(num, max_tokens) if name == "llm" else run_batch(num, max_tokens, int(name), out))
            print(runs[-1], flush=True)
    record = {"num_lines": num, "max_tokens": max_tokens, "load_average": load_average(), "runs": runs}
    write_report(out, "batch.json", record, format_report)
    return 0
