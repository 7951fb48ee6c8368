"""Decode speed with speculative decoding on and off: n-gram drafts, or a draft model's with
`--draft-model` (any model the loader serves, of the target's tokenizer).

Greedy requests, `--output-len` tokens each, on one of two workloads: `overlap` (the model is
asked to repeat a passage given in the prompt: drafts are found and mostly accepted) or
`chat` (ordinary short questions: few drafts). For each `--concurrency` c, c requests at once
(distinct prompts), runs alternating off, on, off, on ... `--repeat` times each in one
process; prints output tokens/s (median of the runs) per setting, and with drafts the
acceptance rate (accepted / draft tokens) of that case. `--disable-by-batch-size` sets the
engine's switch-off rule for the "on" engine (a large value drafts at every batch size:
what the rule is chosen from). `--out DIR` also writes the record (with the machine and its
load average) to DIR/speculative.json.
"""

from __future__ import annotations

import json
import statistics
import time

from benchmarks import records
from benchmarks.options import benchmark_parser

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache keeps each sequence's keys and values "
    "in fixed-size blocks, so memory is allocated on demand and shared between sequences that have the "
    "same prefix. The scheduler decides every step which sequences run, and the block manager decides "
    "where their keys and values live."
)

QUESTIONS = (
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me a few ideas for a rainy weekend.",
    "What is the difference between a virus and a bacterium?",
    "How do I make a good cup of tea?",
    "Why do cats purr?",
    "Suggest a name for a small bakery and say why.",
    "What should I pack for a week of hiking?",
)


def _prompt(workload: str = "overlap", index: int = 0) -> str:
    """Request `index`'s prompt (index 0 of `overlap` is the single-stream prompt)."""
    if workload == "chat":
        question = QUESTIONS[index % len(QUESTIONS)]
        return f"Question {index // len(QUESTIONS) + 1}: {question}\nAnswer:"
    head = "" if index == 0 else f"Request {index}. "
    return f"{head}Repeat this text exactly.\n\nText: {PASSAGE}\n\nRepeated text: {PASSAGE[:60]}"


def main(argv: list[str] | None = None) -> int:
    from rayserve_paged import LLM, SamplingParams

    parser = benchmark_parser("rayserve-paged bench speculative", __doc__, out_help="directory for speculative.json",
                              seed=None)  # fmt: skip
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--draft-model", default=None, help="method draft_model with this draft (else ngram)")
    parser.add_argument("--workload", choices=("overlap", "chat"), default="overlap")
    parser.add_argument("--concurrency", default="1", help="comma-separated numbers of requests at once")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="the on engine's speculative_config.disable_by_batch_size (default: the engine's)")
    parser.add_argument("--min-accepted-per-step", type=float, default=None,
                        help="the on engine's speculative_config.min_accepted_per_step (default: the engine's; "
                        "0: drafts are never paused)")
    parser.add_argument("--threads", type=int, default=None, help="num_cpu_threads of both engines")
    args = parser.parse_args(argv)
    if args.quick:
        args.output_len, args.repeat = min(args.output_len, 8), 1
    concurrency = [int(c) for c in args.concurrency.split(",")]
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_max": 4}
    if args.draft_model is not None:
        k = args.num_speculative_tokens
        spec = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    if args.min_accepted_per_step is not None:
        spec["min_accepted_per_step"] = args.min_accepted_per_step
    common = dict(model=args.model, max_model_len=args.max_model_len, max_num_seqs=max(256, *concurrency),
                  kv_cache_memory_gb=0.25 * max(1, max(concurrency) // 8), num_cpu_threads=args.threads)  # fmt: skip
    engines = {"off": LLM(**common), "on": LLM(**common, speculative_config=spec)}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate([_prompt(args.workload)], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    on = engines["on"].engine
    results = {}
    for c in concurrency:
        prompts = [_prompt(args.workload, i) for i in range(c)]
        rates: dict[str, list[float]] = {"off": [], "on": []}
        outputs = {}
        drafts, accepted = on.scheduler.counters.spec_decode_num_draft_tokens, on.spec_decode_num_accepted_tokens
        for _ in range(args.repeat):
            for name, llm in engines.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
                outputs[name] = [o.outputs[0].token_ids for o in outs]
        drafts = on.scheduler.counters.spec_decode_num_draft_tokens - drafts
        accepted = on.spec_decode_num_accepted_tokens - accepted
        off_rate, on_rate = statistics.median(rates["off"]), statistics.median(rates["on"])
        results[c] = {
            "tokens_per_s_off": round(off_rate, 2),
            "tokens_per_s_on": round(on_rate, 2),
            "speedup": round(on_rate / off_rate, 3),
            "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
            "num_draft_tokens": drafts,
            "same_tokens": outputs["on"] == outputs["off"],
            "runs_off": [round(r, 2) for r in rates["off"]],
            "runs_on": [round(r, 2) for r in rates["on"]],
        }
    load = records.load_average()
    if concurrency == [1]:  # the single-stream report, as before
        result = {"model": args.model, "method": spec["method"], "draft_model": args.draft_model,
                  "output_len": args.output_len, **results[1], "load_average": load}  # fmt: skip
    else:
        result = {"model": args.model, "method": spec["method"], "draft_model": args.draft_model,
                  "output_len": args.output_len, "workload": args.workload, "by_concurrency": results,
                  "load_average": load}  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.out:
        records.write_json(args.out, "speculative.json", {"benchmark": "speculative", "workload": args.workload,
                                                            "spec": spec, "results": results})  # fmt: skip
    return 0
