"""Structured outputs on CPU: the mask cost per constrained row per step, grammar compile
time (cold and cached), and engine tokens/s with 0%, 50% and 100% of a batch constrained.

    mask      k constrained sequences (k = 1, 16, 64) of one JSON schema (SCHEMA: nested
              object, array, enum, integer range), each driven by random allowed tokens.
              Per step, timed apart: build (StructuredOutputs.fill: the k packed bitmasks),
              apply (the Sampler's control pass on [k, vocab] float32 logits: unpack the
              bits, mask), accept (each matcher consumes its token). Reported: median
              microseconds per row per step, over --mask-steps steps, per tokenizer (the
              tiny tokenizer, vocab 512; SmolLM2's, vocab 49152).
    hostile   the same at k = 16 and 64 for HOSTILE, valid constraints at the grammar's
              limits, round-robin over the rows (those the compiler refuses are left out
              and named); a row whose grammar ends or fails starts again. Reported: median
              and max microseconds of build per row per step, over --hostile-steps steps.
    compile   SCHEMA compiled by a fresh GrammarCompiler (cold: the tokenizer already
              built, timed apart) and again from its cache (cached); then each of HOSTILE
              and SCHEMA cold, with the process's resident-memory growth it left behind
              (its cache entry's bytes), or the refusal.
    batch     LLM.generate of 64 requests (prompts of 32 random tokens, 64 output tokens
              each, greedy, ignore_eos) on the throughput benchmark's small OPT (6 layers,
              hidden 512, vocab 512); 0, 32 or 64 of them constrained by LONG_SCHEMA (a JSON
              object whose one string needs more than 64 tokens: every row runs its 64).
              Output tokens / wall seconds and / CPU seconds (this process, all threads: the
              steadier figure on a shared machine), the median of --repeats rounds after a
              warm-up round; each round runs the three shares in turn.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks.options import benchmark_parser
from benchmarks.records import write_record
from rayserve_paged import LLM, SamplingParams, StructuredOutputsParams
from rayserve_paged.models.sampler import Sampler, SamplingBatch
from rayserve_paged.models.tiny import SPECIAL_TOKENS, TINY_VOCAB_SIZE, make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
             "$ref": "#/$defs/n"}  # fmt: skip
HOSTILE = {
    "required-recursion": {"json": RECURSIVE},
    "string-or-recursion": {"json": {"$defs": RECURSIVE["$defs"],
                                     "anyOf": [{"type": "string", "maxLength": 3}, {"$ref": "#/$defs/n"}]}},
    "lark-a-start": {"grammar": 'start: "a" start'},
    "gbnf-x-root": {"grammar": 'root ::= "x" root'},
    "nested-repeats": {"regex": "^((a{1,100}){1,100}){1,100}$"},
    "huge-repeat": {"regex": "m0(a{1000}){1000}"},
}  # fmt: skip
LONG_SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}}, "required": ["story"]}
SMALL_OPT = {"num_hidden_layers": 6, "hidden_size": 512, "word_embed_proj_dim": 512, "num_attention_heads": 8,
             "ffn_dim": 2048, "vocab_size": TINY_VOCAB_SIZE, "max_position_embeddings": 2048}  # fmt: skip
NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 64, 32, 64


def _engine(model: str, **options) -> LLM:
    return LLM(model=model, dtype="float32", device="cpu", num_cpu_threads=1, enable_prefix_caching=False, **options)


def time_masks(llm: LLM, num_rows: int, steps: int, seed: int, constraints: list | None = None) -> dict:
    """Median us per row per step of build, apply and accept for num_rows sequences (of
    `constraints`, round-robin; SCHEMA by default)."""
    engine = llm.engine
    structured = engine.structured
    compiled = [engine.grammars.compile(c) for c in constraints or [StructuredOutputsParams(json=SCHEMA)]]
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    sampler = Sampler()
    times = {"build": [], "apply": [], "accept": []}
    seq_ids = list(range(10**6, 10**6 + num_rows))
    grammar_of = {s: compiled[i % len(compiled)] for i, s in enumerate(seq_ids)}
    for s in seq_ids:
        structured.add(s, grammar_of[s].new_matcher())
    rows = tuple(range(num_rows))
    logits = torch.randn(num_rows, vocab)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            packed, _ = structured.fill(seq_ids)
            t1 = time.perf_counter()
            bitmask = torch.frombuffer(bytearray(packed), dtype=torch.int32).view(num_rows, -1)
            batch = SamplingBatch(seq_ids, (1.0,) * num_rows, (-1,) * num_rows, (1.0,) * num_rows, (0.0,) * num_rows,
                                  (None,) * num_rows, (0,) * num_rows, (0,) * num_rows, (1,) * num_rows,
                                  (0,) * num_rows, (None,) * num_rows, token_bitmask_rows=rows, token_bitmask=bitmask)  # fmt: skip
            t2 = time.perf_counter()
            masked = sampler._apply_controls(logits, batch)
            t3 = time.perf_counter()
            allowed = torch.isfinite(masked)
            tokens = [rng.choice(torch.nonzero(allowed[r]).flatten().tolist()) for r in rows]
            t4 = time.perf_counter()
            ended = [structured.accept(s, t)[0] for s, t in zip(seq_ids, tokens)]
            t5 = time.perf_counter()
            times["build"].append((t1 - t0) / num_rows)
            times["apply"].append((t3 - t2) / num_rows)
            times["accept"].append((t5 - t4) / num_rows)
            for s, is_done in zip(seq_ids, ended):
                state = structured.matchers.get(s)
                if is_done or state is None or state.matcher.is_error():  # ended or failed: start again
                    structured.remove(s)
                    structured.add(s, grammar_of[s].new_matcher())
    finally:
        for s in seq_ids:
            structured.remove(s)
    result = {key: round(statistics.median(values) * 1e6, 1) for key, values in times.items()}
    result["total"] = round(sum(result.values()), 1)
    result["build_max"] = round(max(times["build"]) * 1e6, 1)
    return result


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def time_hostile(llm: LLM, steps: int, seed: int) -> dict:
    """Per constraint: cold compile ms and the resident MiB it left (or its refusal); then
    the mask build of the compilable ones at 16 and 64 rows."""
    from rayserve_paged.engine.structured_outputs import GrammarCompiler

    engine = llm.engine
    kept, compiles, alive = [], {}, []  # compilers stay alive: each entry's memory stays resident
    for name, constraint in {**HOSTILE, "benign-schema": {"json": SCHEMA}}.items():
        params = StructuredOutputsParams(**constraint)
        compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, tuple(engine.eos_token_ids))
        compiler.ll_tokenizer()
        before, t0 = _resident_mib(), time.perf_counter()
        try:
            compiler.compile(params)
        except ValueError as e:
            compiles[name] = {"refused": str(e)[:160], "ms": round((time.perf_counter() - t0) * 1e3, 1)}
        else:
            compiles[name] = {"ms": round((time.perf_counter() - t0) * 1e3, 1),
                              "resident_mib": round(_resident_mib() - before, 1)}  # fmt: skip
            if name in HOSTILE:
                kept.append(params)
        compiler.shutdown()
        alive.append(compiler)
    masks = {k: time_masks(llm, k, steps, seed, kept) for k in (16, 64)} if kept else {}
    return {"compile": compiles, "mask": masks, "masked": [n for n, c in HOSTILE.items() if "refused" not in compiles[n]]}


def time_compile(llm: LLM) -> dict:
    from rayserve_paged.engine.structured_outputs import GrammarCompiler

    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, tuple(engine.eos_token_ids))
    t0 = time.perf_counter()
    compiler.ll_tokenizer()
    t1 = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=SCHEMA))
    t2 = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=SCHEMA))
    t3 = time.perf_counter()
    compiler.shutdown()
    return {"tokenizer_ms": round((t1 - t0) * 1e3, 2), "cold_ms": round((t2 - t1) * 1e3, 2),
            "cached_ms": round((t3 - t2) * 1e3, 3)}  # fmt: skip


def batch_requests(num_constrained: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(f"structured-{seed}")
    first = len(SPECIAL_TOKENS)
    prompts = [[rng.randrange(first, TINY_VOCAB_SIZE) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    free = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True,
                                 structured_outputs={"json": LONG_SCHEMA})  # fmt: skip
    # constrained rows spread through the batch (every other one at 50%)
    step = NUM_REQUESTS // num_constrained if num_constrained else 0
    params = [constrained if step and i % step == 0 and i // step < num_constrained else free
              for i in range(NUM_REQUESTS)]  # fmt: skip
    return prompts, params


def time_batches(llm: LLM, shares: tuple[int, ...], repeats: int, seed: int) -> list[dict]:
    """Rounds over the shares, interleaved (a warm-up round first), so that a shared
    machine's load changes hit every share alike; the median wall and CPU seconds each."""
    work = {share: batch_requests(share, seed) for share in shares}
    runs: dict[int, list[tuple[float, float]]] = {share: [] for share in shares}
    for _ in range(repeats + 1):
        for share, (prompts, params) in work.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            runs[share].append((time.perf_counter() - t0, time.process_time() - c0))
            num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            assert num_tokens == NUM_REQUESTS * OUTPUT_LEN, num_tokens
    results = []
    for share in shares:
        wall = statistics.median(w for w, _ in runs[share][1:])
        cpu = statistics.median(c for _, c in runs[share][1:])
        results.append({"constrained": share, "output_tokens": NUM_REQUESTS * OUTPUT_LEN, "seconds": round(wall, 3),
                        "cpu_seconds": round(cpu, 3), "tokens_per_s": round(NUM_REQUESTS * OUTPUT_LEN / wall, 1),
                        "tokens_per_cpu_s": round(NUM_REQUESTS * OUTPUT_LEN / cpu, 1)})  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench structured-outputs", __doc__.splitlines()[0],
                              out_help="directory for structured_outputs.json",
                              quick_help="the tiny OPT's tokenizer only, 20 mask steps, one batch run (for tests)")
    parser.add_argument("--mask-steps", type=int, default=200)
    parser.add_argument("--hostile-steps", type=int, default=10, help="mask steps of the hostile set")
    parser.add_argument("--repeats", type=int, default=3, help="timed batch runs per share (after one warm-up)")
    parser.add_argument("--models", default="tiny-opt,smollm2", help="tokenizers for the mask and compile figures")
    parser.add_argument("--skip-batch", action="store_true", help="only the mask and compile figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.mask_steps, args.repeats, args.hostile_steps = "tiny-opt", 20, 1, 2
    torch.set_num_threads(1)
    np.random.seed(args.seed)
    results: dict = {"mask": {}, "compile": {}, "hostile": {}, "batch": []}
    for model in args.models.split(","):
        llm = _engine(model, max_model_len=512, num_gpu_blocks_override=64, swap_space_gb=0.01)
        results["compile"][model] = time_compile(llm)
        results["mask"][model] = {k: time_masks(llm, k, args.mask_steps, args.seed) for k in (1, 16, 64)}
        print(f"{model}: compile {results['compile'][model]}")
        for k, row in results["mask"][model].items():
            print(f"  mask, {k:2d} rows (us per row per step): {row}")
        results["hostile"][model] = hostile = time_hostile(llm, args.hostile_steps, args.seed)
        for name, row in hostile["compile"].items():
            print(f"  compile {name}: {row}")
        for k, row in hostile["mask"].items():
            print(f"  hostile mask ({', '.join(hostile['masked'])}), {k:2d} rows (us per row per step): {row}")
    if not args.skip_batch:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(make_tiny_model("opt", tmp, **SMALL_OPT))
            llm = _engine(model_dir, kv_cache_memory_gb=0.2)
            results["batch"] = time_batches(llm, (0, NUM_REQUESTS // 2, NUM_REQUESTS), args.repeats, args.seed)
            for row in results["batch"]:
                print(f"  batch of {NUM_REQUESTS}, {row['constrained']} constrained: {row}")
    if args.out:
        write_record(args.out, "structured-outputs", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
