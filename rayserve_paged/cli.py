"""The `rayserve-paged` command: make-tiny-model, generate, demo, bench."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# name -> module in the top-level `benchmarks` package; each has main(argv) -> int
BENCHMARKS = {
    "memory": "benchmarks.memory",
    "mixed": "benchmarks.mixed_load",
    "scheduler": "benchmarks.scheduler_step",
    "sharing": "benchmarks.sharing",
    "throughput": "benchmarks.throughput",
    "ray-overhead": "benchmarks.ray_overhead",
    "telemetry": "benchmarks.telemetry_cost",
    "serving": "benchmarks.serving",
}

DEMO_PROMPTS = [
    "The paged KV cache stores",
    "Once upon a time, a small model",
    "Ray Serve deployments",
]


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        names = ", ".join(sorted(BENCHMARKS))
        print(f"usage: rayserve-paged bench {{{names}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


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
    outputs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
    for out in outputs:
        for completion in out.outputs:
            if args.json:
                record = {
                    "prompt": out.prompt,
                    "index": completion.index,
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                }
                print(json.dumps(record))
            else:
                print(f"{out.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    return 0


def _demo(args) -> int:
    """Offline generation with the embedded tiny model: no GPU, no network."""
    from rayserve_paged import LLM, SamplingParams

    llm = LLM(model="tiny-opt", max_model_len=512, kv_cache_memory_gb=0.1, swap_space_gb=0.1)
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=24, seed=0)
    outputs = llm.generate(DEMO_PROMPTS, params)
    for out in outputs:
        print(f"\nprompt: {out.prompt!r}")
        for completion in out.outputs:
            print(f"  [{completion.index}] {completion.text!r}  ({len(completion.token_ids)} tokens)")
    usage = llm.engine.block_manager.usage()
    print(f"\nKV blocks: {usage.gpu_total} of {usage.block_size} tokens; in use after the batch: {usage.gpu_used}")
    print("(tiny-opt has random weights: the text is not meant to read well)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayserve-paged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="run a benchmark: rayserve-paged bench NAME --out DIR", add_help=False)

    tiny = sub.add_parser("make-tiny-model", help="write a deterministic tiny checkpoint in HF format")
    tiny.add_argument("--arch", choices=["opt", "llama"], required=True)
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_make_tiny_model)

    gen = sub.add_parser("generate", help="offline generation with the LLM class")
    gen.add_argument("--model", default="tiny-opt")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
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

    demo = sub.add_parser("demo", help="offline generation with the embedded tiny model")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
