"""Single-stream decode speed with speculative decoding on and off: n-gram drafts, or a
draft model's with `--draft-model` (any model the loader serves, of the target's tokenizer).

One greedy request at a time on a high-overlap prompt (the model is asked to repeat a
passage given in the prompt), `--output-len` tokens each, runs alternating off, on, off, on
... `--repeat` times each in one process; prints tokens/s (median of the runs) per setting,
and with drafts the acceptance rate (accepted / draft tokens) and the mean tokens a step adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache keeps each sequence's keys and values "
    "in fixed-size blocks, so memory is allocated on demand and shared between sequences that have the "
    "same prefix. The scheduler decides every step which sequences run, and the block manager decides "
    "where their keys and values live."
)


def _prompt() -> str:
    return f"Repeat this text exactly.\n\nText: {PASSAGE}\n\nRepeated text: {PASSAGE[:60]}"


def main(argv: list[str] | None = None) -> int:
    from rayserve_paged import LLM, SamplingParams

    parser = argparse.ArgumentParser(prog="rayserve-paged bench speculative", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--draft-model", default=None, help="method draft_model with this draft (else ngram)")
    args = parser.parse_args(argv)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_max": 4}
    if args.draft_model is not None:
        k = args.num_speculative_tokens
        spec = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k}
    engines = {
        "off": LLM(model=args.model, max_model_len=args.max_model_len, kv_cache_memory_gb=0.25),
        "on": LLM(model=args.model, max_model_len=args.max_model_len, kv_cache_memory_gb=0.25, speculative_config=spec),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompt = _prompt()
    for llm in engines.values():  # warm-up
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    outputs = {}
    for _ in range(args.repeat):
        for name, llm in engines.items():
            start = time.perf_counter()
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            rates[name].append(len(out.outputs[0].token_ids) / (time.perf_counter() - start))
            outputs[name] = out.outputs[0].token_ids
    engine = engines["on"].engine
    drafts = engine.scheduler.counters.spec_decode_num_draft_tokens
    accepted = engine.spec_decode_num_accepted_tokens
    result = {
        "model": args.model,
        "method": spec["method"],
        "draft_model": args.draft_model,
        "output_len": args.output_len,
        "tokens_per_s_off": round(statistics.median(rates["off"]), 2),
        "tokens_per_s_on": round(statistics.median(rates["on"]), 2),
        "speedup": round(statistics.median(rates["on"]) / statistics.median(rates["off"]), 3),
        "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
        "same_tokens": outputs["on"] == outputs["off"],
        "runs_off": [round(r, 2) for r in rates["off"]],
        "runs_on": [round(r, 2) for r in rates["on"]],
    }
    print(json.dumps(result, indent=2))
    return 0
