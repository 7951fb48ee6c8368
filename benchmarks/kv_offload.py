"""Prefix-cache tier 2 (kv_offload_memory_gb): time to first token and prefill tokens
computed on a working set of long shared prefixes bigger than the device pool, tier off
against tier 2 on.

Workload: `--docs` documents of `--doc-len` random tokens, asked about in turn for
`--rounds` rounds (round r, document d: the document, then a question of 8 tokens that
differ per round; 4 greedy output tokens). One request at a time through one LLMEngine, so
each TTFT is that request's own prefill (or restore) and nothing else. The device pool
holds `--pool-share` of the working set's blocks (and at least one request); tier 2 holds
all of it. Round 1 is cold in both configurations and reported apart; the figures are over
rounds 2 and later, where tier off recomputes evicted documents and tier 2 restores them.

    ttft_p50_s / ttft_p99_s   from add_request to the step that returns the first token
    prefill_tokens            prompt tokens computed (engine.num_prompt_tokens)
    outputs_equal             the greedy tokens of both configurations are the same

Model: SmolLM2-135M-Instruct (the embedded GGUF, float32, dequantized) by default; `--quick`
uses the tiny random llama (seconds, for tests).
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time

from benchmarks.options import benchmark_parser
from benchmarks.records import progress, write_json

BLOCK_SIZE = 16
QUESTION_LEN = 8
MAX_TOKENS = 4


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    docs = [[rng.randrange(10, vocab) for _ in range(args.doc_len)] for _ in range(args.docs)]
    return [doc + [rng.randrange(10, vocab) for _ in range(QUESTION_LEN)] for _ in range(args.rounds) for doc in docs]


def _run(model: str, prompts: list[list[int]], num_blocks: int, offload_gb: float, options: dict) -> dict:
    from rayserve_paged.config import EngineConfig
    from rayserve_paged.core import SamplingParams
    from rayserve_paged.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(model=model, num_gpu_blocks_override=num_blocks, kv_offload_memory_gb=offload_gb, **options)
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ttfts, outputs, prefill = [], [], []
    for i, prompt in enumerate(prompts):
        before = engine.num_prompt_tokens
        started = time.perf_counter()
        engine.add_request(f"q{i}", None, params, prompt_token_ids=prompt)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter() - started
                if out.finished:
                    outputs.append(list(out.outputs[0].token_ids))
        ttfts.append(first)
        prefill.append(engine.num_prompt_tokens - before)
    c = engine.block_manager.counters
    return {
        "ttfts": ttfts,
        "prefill": prefill,
        "outputs": outputs,
        "counters": {
            "device_hits": c.prefix_cache_hits,
            "host_hits": c.offload_hits,
            "offloaded_blocks": c.offloaded_blocks,
            "restored_blocks": c.restored_blocks,
            "offload_evicted_blocks": c.offload_evicted_blocks,
        },
        "block_bytes": engine.cache_sizes.block_bytes,
    }


def _summary(run: dict, first_round: int) -> dict:
    warm = run["ttfts"][first_round:]
    return {
        "cold_ttft_p50_s": round(_percentile(run["ttfts"][:first_round], 0.5), 4),
        "ttft_p50_s": round(_percentile(warm, 0.5), 4),
        "ttft_p99_s": round(_percentile(warm, 0.99), 4),
        "prefill_tokens": sum(run["prefill"][first_round:]),
        **run["counters"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(
        "rayserve-paged bench kv-offload", __doc__.split("\n\n")[0], out_help="directory for kv_offload.json",
        out_required=True,
    )
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool-share", type=float, default=0.25, help="device pool / working set, in blocks")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            from rayserve_paged.models.tiny import TINY_VOCAB_SIZE, make_tiny_model

            args.docs, args.doc_len, args.rounds = 4, 64, 2
            model, vocab, label = str(make_tiny_model("llama", os.path.join(tmp, "llama"))), TINY_VOCAB_SIZE, "tiny-llama"
            options = {"device": "cpu"}
        else:
            model, vocab, label = "smollm2", 49152, "SmolLM2-135M-Instruct (float32)"
            options = {"device": "cpu", "dtype": "float32", "quantization": "none"}
        per_request = -(-(args.doc_len + QUESTION_LEN + MAX_TOKENS) // BLOCK_SIZE)
        max_len = per_request * BLOCK_SIZE
        options.update(swap_space_gb=0.01, max_model_len=max_len, max_num_batched_tokens=max_len, max_num_seqs=4)
        prompts = _workload(args, vocab)
        working_set = args.docs * (args.doc_len // BLOCK_SIZE)
        num_blocks = max(per_request + 1, int(working_set * args.pool_share))
        runs = {}
        for name, offload_gb in (("tier_off", 0.0), ("tier_2", None)):
            if offload_gb is None:  # every document's blocks fit tier 2
                offload_gb = 2 * working_set * runs["tier_off"]["block_bytes"] / 2**30
            progress(f"kv-offload: {name} ({label}, {num_blocks} device blocks)")
            runs[name] = _run(model, prompts, num_blocks, offload_gb, options)
    results = {name: _summary(run, args.docs) for name, run in runs.items()}
    results["outputs_equal"] = runs["tier_off"]["outputs"] == runs["tier_2"]["outputs"]
    off, on = results["tier_off"], results["tier_2"]
    results["ttft_p50_ratio"] = round(on["ttft_p50_s"] / off["ttft_p50_s"], 3)
    for name in ("tier_off", "tier_2"):
        print(name, "  ".join(f"{k} {v}" for k, v in results[name].items()))
    print("outputs_equal", results["outputs_equal"], " ttft_p50 tier_2 / tier_off", results["ttft_p50_ratio"])
    record = {
        "model": label,
        "device_blocks": num_blocks,
        "working_set_blocks": working_set,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
    }
    write_json(args.out, "kv_offload.json", record)
    return 0 if results["outputs_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
