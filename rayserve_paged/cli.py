"""The `rayserve-paged` command: serve, batch, make-tiny-model, generate, demo, bench."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayserve_paged.batch import BatchConfig

# name -> module in the top-level `benchmarks` package; each has main(argv) -> int
BENCHMARKS = {
    "batch": "benchmarks.batch",
    "fleet-routing": "benchmarks.fleet_routing",
    "memory": "benchmarks.memory",
    "mixed": "benchmarks.mixed_load",
    "scheduler": "benchmarks.scheduler_step",
    "sharing": "benchmarks.sharing",
    "throughput": "benchmarks.throughput",
    "ray-overhead": "benchmarks.ray_overhead",
    "telemetry": "benchmarks.telemetry_cost",
    "attention-host": "benchmarks.attention_host",
    "sampler-host": "benchmarks.sampler_host",
    "embeddings": "benchmarks.embeddings",
    "serving": "benchmarks.serving",
    "smollm2": "benchmarks.smollm2",
    "structured-outputs": "benchmarks.structured_outputs",
    "quantized": "benchmarks.quantized",
    "lora": "benchmarks.lora",
    "stream-cadence": "benchmarks.stream_cadence",
    "report": "benchmarks.report",
    "responses-host": "benchmarks.responses_host",
    "load": "benchmarks.load",
    "priority": "benchmarks.priority",
    "routing-cost": "benchmarks.routing_cost",
    "kv-offload": "benchmarks.kv_offload",
    "speculative": "benchmarks.speculative",
}

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
]

# The embedded SmolLM2-135M-Instruct on CPU: KV for 1024-token sequences in 0.1 GiB.
DEMO_ENGINE = {"max_model_len": 1024, "kv_cache_memory_gb": 0.1, "swap_space_gb": 0.1, "device": "cpu"}


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        names = ", ".join(sorted(BENCHMARKS))
        print(f"usage: rayserve-paged bench {{{names}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


class _Stop(BaseException):
    """Ctrl-C in `rayserve-paged serve`: a BaseException other than KeyboardInterrupt, so
    `serve run`'s own handler (which kills the proxies at once) does not take it."""


def _raise_stop(signum, frame) -> None:
    raise _Stop(signum)


def _serve(argv: list[str]) -> int:
    """`serve run ARGS` in this process, stopped by SIGTERM (what systemd, Docker and a
    background shell send) or Ctrl-C alike: the applications are deleted first, so every
    replica stops taking requests and finishes its streams within its
    graceful_shutdown_timeout_s while the proxies still carry them, then Serve shuts down
    and the command exits 0. A second signal stops at once.

    `serve run` alone stops Serve outright on Ctrl-C (in-flight streams are cut) and dies of
    SIGTERM: Ray's driver turns SIGTERM into sys.exit(15), which ends up here as SystemExit.
    Ray's C++ crash handler, which prints a stack trace for a SIGTERM and aborts the process
    at exit, is left out of this process only (its Ray processes keep theirs)."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray  # noqa: F401  (reads the variable once, at import)
        from ray.serve.scripts import run
    finally:
        if os.environ.get("RAY_DISABLE_FAILURE_SIGNAL_HANDLER") == "1":
            del os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"]

    previous = signal.signal(signal.SIGINT, _raise_stop)
    try:
        run.main(argv, prog_name="serve run", standalone_mode=False)
        return 0
    except (_Stop, SystemExit) as stop:
        if isinstance(stop, SystemExit) and stop.code != signal.SIGTERM:
            raise
        return _drain_and_shut_down(signal.Signals(stop.args[0] if isinstance(stop, _Stop) else stop.code))
    finally:
        signal.signal(signal.SIGINT, previous)


def _drain_and_shut_down(signum: signal.Signals, poll_s: float = 0.5) -> int:
    import ray
    from ray import serve

    if not ray.is_initialized():  # stopped before `serve run` connected: nothing runs yet
        return 0
    names = list(serve.status().applications)
    print(f"Got {signum.name}: deleting {names}; their replicas finish the requests in flight "
          "(graceful_shutdown_timeout_s), then Serve shuts down. Send it again to stop at once.", flush=True)  # fmt: skip
    try:
        for name in names:
            serve.delete(name, _blocking=False)
        while any(name in serve.status().applications for name in names):
            time.sleep(poll_s)
        print("Applications drained and deleted; shutting down Serve.", flush=True)
    except (_Stop, SystemExit) as again:
        if isinstance(again, SystemExit) and again.code != signal.SIGTERM:
            raise
        print("Second signal: shutting down Serve now.", flush=True)
    serve.shutdown()
    return 0


def _make_tiny_model(args) -> int:
    from rayserve_paged.models.tiny import make_tiny_model

    path = make_tiny_model(args.arch, args.out, seed=args.seed)
    print(path)
    return 0


def _engine_options(args) -> dict:
    options = {"max_model_len": args.max_model_len, "block_size": args.block_size}
    if args.kv_cache_memory_gb is not None:
        options["kv_cache_memory_gb"] = args.kv_cache_memory_gb
    if args.device is not None:
        options["device"] = args.device
    return options


def _generate(args) -> int:
    from rayserve_paged import LLM, SamplingParams

    llm = LLM(model=args.model, **_engine_options(args))
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        use_beam_search=args.beam_search,
    )
    if args.chat:
        conversations = [[{"role": "user", "content": prompt}] for prompt in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=len(args.prompt) > 1)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
    for prompt, out in zip(args.prompt, outputs):  # the question, not the rendered chat template
        for completion in out.outputs:
            if args.json:
                record = {
                    "prompt": prompt,
                    "index": completion.index,
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                }
                print(json.dumps(record))
            else:
                print(f"{prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    return 0


def _demo(args) -> int:
    """Chat with the embedded SmolLM2-135M-Instruct offline: no GPU, no network. Each question
    gets a greedy answer and two sampled ones (n=2 shares the prompt's KV blocks)."""
    from rayserve_paged import LLM, SamplingParams

    llm = LLM(model=args.model, **DEMO_ENGINE)
    conversations = [[{"role": "user", "content": question}] for question in DEMO_QUESTIONS]
    greedy = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=48))
    sampled = llm.chat(conversations, SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=48, seed=0))
    for question, best, samples in zip(DEMO_QUESTIONS, greedy, sampled):
        print(f"\nuser: {question}")
        print(f"  greedy:     {best.outputs[0].text!r}")
        for completion in samples.outputs:
            print(f"  sampled [{completion.index}]: {completion.text!r}")
    usage = llm.engine.block_manager.usage()
    print(f"\nKV blocks: {usage.gpu_total} of {usage.block_size} tokens; in use after the batch: {usage.gpu_used}")
    return 0


def batch_config(args) -> BatchConfig:
    """The job's BatchConfig: --config's engine options, then the flags. A Serve config
    (configs/*.yaml) gives its application's args, checked as `serve run` checks them
    (AppArgs): the engine, served_model_name, tool_call_parser, worker_cpus; any other
    YAML mapping is BatchConfig's own fields."""
    import yaml

    from rayserve_paged.app import AppArgs
    from rayserve_paged.batch import BatchConfig
    from rayserve_paged.config import EngineConfig

    fields: dict = {}
    if args.config is not None:
        with open(args.config) as f:
            loaded = yaml.safe_load(f) or {}
        if "applications" in loaded:
            apps = [a for a in loaded["applications"] if a.get("import_path") == "rayserve_paged.app:build_app"]
            if not apps:
                raise SystemExit(f"{args.config}: no application with import_path rayserve_paged.app:build_app")
            app = AppArgs.model_validate(apps[0].get("args") or {})
            engine = {name: getattr(app, name) for name in EngineConfig.model_fields}
            fields = {"engine": engine, "served_model_name": app.served_model_name,
                      "tool_call_parser": app.tool_call_parser, "worker_cpus": app.worker_cpus}  # fmt: skip
        else:
            fields = dict(loaded)
    engine = dict(fields.get("engine") or BatchConfig().engine.model_dump())
    for option in args.engine:
        name, sep, value = option.partition("=")
        if not sep:
            raise SystemExit(f"--engine: expected KEY=VALUE (got {option!r})")
        engine[name] = yaml.safe_load(value)
    fields["engine"] = engine
    low, _, high = args.concurrency.partition(",")
    flags = {"concurrency": (int(low), int(high)) if high else int(low), "batch_size": args.batch_size,
             "max_concurrent_batches": args.max_concurrent_batches, "max_retries": args.max_retries,
             "worker_cpus": args.worker_cpus}  # fmt: skip
    fields.update({name: value for name, value in flags.items() if value is not None})
    return BatchConfig.model_validate(fields)


def _batch(args) -> int:
    from rayserve_paged.batch.job import run_batch_file
    from rayserve_paged.deployments.serving.batch_routes import OpenAIBatchRoutes

    config = batch_config(args)
    summary = run_batch_file(
        args.input, args.output, config, OpenAIBatchRoutes, address=args.address, progress=not args.no_progress
    )
    rate = summary.num_written / summary.elapsed_s if summary.elapsed_s else 0.0
    tokens = summary.num_output_tokens / summary.elapsed_s if summary.elapsed_s else 0.0
    print(f"{args.output}: {summary.num_lines} lines; {summary.num_written} answered now ({summary.num_errors} "
          f"with an error status), {summary.num_skipped} written before; {summary.elapsed_s:.1f} s, "
          f"{rate:.2f} lines/s, {tokens:.1f} output tokens/s")  # fmt: skip
    for name, stats in sorted(summary.replicas.items()):
        print(f"  engine actor {name}: {stats.num_steps} steps, {stats.busy_s:.1f} s stepping, "
              f"{stats.idle_s:.1f} s idle")  # fmt: skip
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayserve-paged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="run a benchmark: rayserve-paged bench NAME --out DIR", add_help=False)
    sub.add_parser(
        "serve",
        help="`serve run CONFIG [options]` that drains on SIGTERM or Ctrl-C (streams finish, exit 0)",
        add_help=False,
    )

    batch = sub.add_parser(
        "batch", help="answer an OpenAI batch file on Ray Data: rayserve-paged batch INPUT.jsonl OUTPUT.jsonl"
    )
    batch.add_argument("input", help="OpenAI batch lines for /v1/chat/completions and /v1/completions")
    batch.add_argument("output", help="one result line per input line; OUTPUT.parts/ holds the job's progress")
    batch.add_argument("--config", help="a Serve config (configs/*.yaml) or BatchConfig fields; "
                       "default: the embedded SmolLM2-135M-Instruct on the CPU")  # fmt: skip
    batch.add_argument("--address", default="local",
                       help="'local' (default): a Ray instance of the job's own; 'auto': this node's cluster")  # fmt: skip
    batch.add_argument("--concurrency", default="1", help="engine actors: N, or MIN,MAX to autoscale")
    batch.add_argument("--batch-size", type=int, default=None, help="rows per batch (default 16)")
    batch.add_argument("--max-concurrent-batches", type=int, default=None, help="batches per engine actor at once (4)")
    batch.add_argument("--max-retries", type=int, default=None, help="retries of a batch whose actor died (2)")
    batch.add_argument("--worker-cpus", type=float, default=None, help="CPUs reserved per engine actor")
    batch.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                       help="an engine option over the config's (e.g. num_cpu_threads=1); repeatable")  # fmt: skip
    batch.add_argument("--no-progress", action="store_true", help="no progress bars")
    batch.set_defaults(run=_batch)

    tiny = sub.add_parser("make-tiny-model", help="write a deterministic tiny checkpoint in HF format")
    tiny.add_argument("--arch", choices=["opt", "llama"], required=True)
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_make_tiny_model)

    gen = sub.add_parser("generate", help="offline generation with the LLM class")
    gen.add_argument("--model", default="smollm2", help="smollm2 (embedded), tiny-opt, tiny-llama, a path or hub id")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--chat", action="store_true", help="each prompt is a user message, through the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("-n", type=int, default=1)
    gen.add_argument("--beam-search", action="store_true")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    gen.add_argument("--kv-cache-memory-gb", type=float, default=None)
    gen.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    gen.add_argument("--json", action="store_true", help="one JSON object per output")
    gen.set_defaults(run=_generate)

    demo = sub.add_parser("demo", help="offline chat with the embedded SmolLM2-135M-Instruct")
    demo.add_argument("--model", default="smollm2", help="a model with a chat template")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    args = _parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
