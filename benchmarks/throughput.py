"""Offline throughput on CPU: this engine versus Hugging Face transformers `generate` with
static batches, on the same requests and the same random-weight OPT.

    engine   LLM.generate with every request at once: iteration-level scheduling, paged KV
             cache, a finished sequence leaves the batch at once and a waiting one takes
             its place
    hf       AutoModelForCausalLM.generate over static batches in request order, left
             padded; a batch runs until its longest request has its tokens (shorter ones
             keep decoding: that work is wasted), then the next batch starts. The batch
             size is the best of a sweep (tokens/s on the first requests), or --hf-batch-size.

Both decode greedily, ignore EOS (the engine: ignore_eos; HF: min_new_tokens = max_new_tokens)
and run float32 on the CPU with the same torch intra-op thread count. Output tokens per
second = the requests' output tokens (each request's own length, never HF's padding or
overrun) / wall seconds of the generate calls, after one untimed warm-up call each. Model
loading is not timed.

Two cases, each engine against HF on the same requests (random token ids):

    uniform       200 requests, prompt and output lengths uniform on 16..256 (inclusive):
                  static batches waste the decode steps of their shorter requests
    equal_length  128 requests, every prompt and every output 128 tokens: static batching
                  wastes nothing, so this isolates the cost of a step

Besides wall seconds, each run records the process's CPU seconds (all threads): on a shared
machine the engine / HF ratio per CPU second is the steadier figure.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from benchmarks.options import benchmark_parser
from benchmarks.records import load_average, progress, write_report
from benchmarks import workloads
from benchmarks.workloads import Request, uniform_requests
from rayserve_paged import LLM, SamplingParams
from rayserve_paged.models.tiny import SPECIAL_TOKENS, TINY_VOCAB_SIZE, make_tiny_model

DEFAULT_SEED = 0
DEFAULT_THREADS = 1  # robust on a shared CPU: a descheduled second thread stalls every op
HF_BATCH_SIZES = (8, 16, 32)
NUM_PROFILE_REQUESTS = 32
PAD_TOKEN_ID = 0  # the tiny tokenizer's <pad>
TARGET_RATIO = 3.0  # uniform lengths
TARGET_RATIO_EQUAL = 1.0  # equal lengths


@dataclass(frozen=True, slots=True)
class Workload(workloads.Workload):
    num_sweep_requests: int  # HF batch-size sweep: tokens/s on the first requests only
    model: dict  # config.json overrides of the tiny OPT


FULL = Workload(
    num_requests=200,
    min_prompt_len=16,
    max_prompt_len=256,
    min_output_len=16,
    max_output_len=256,
    num_sweep_requests=32,
    # 6 layers, hidden 512, 8 heads of 64, ffn 2048: ~19M parameters in the layers, so the
    # model, not Python, dominates a step. The tiny tokenizer's vocabulary (512).
    model={
        "num_hidden_layers": 6,
        "hidden_size": 512,
        "word_embed_proj_dim": 512,
        "num_attention_heads": 8,
        "ffn_dim": 2048,
        "vocab_size": TINY_VOCAB_SIZE,
        "max_position_embeddings": 2048,
    },
)
EQUAL = Workload(
    num_requests=128,
    min_prompt_len=128,
    max_prompt_len=128,
    min_output_len=128,
    max_output_len=128,
    num_sweep_requests=32,
    model=FULL.model,
)
QUICK = Workload(
    num_requests=8,
    min_prompt_len=4,
    max_prompt_len=32,
    min_output_len=4,
    max_output_len=24,
    num_sweep_requests=8,
    model={},  # the default tiny OPT: 2 layers, hidden 64
)
QUICK_EQUAL = Workload(
    num_requests=8,
    min_prompt_len=16,
    max_prompt_len=16,
    min_output_len=12,
    max_output_len=12,
    num_sweep_requests=8,
    model={},
)


def make_requests(workload: Workload, seed: int) -> list[Request]:
    return uniform_requests(workload, f"throughput-{seed}", len(SPECIAL_TOKENS), TINY_VOCAB_SIZE)


def kv_cache_gb(workload: Workload, model_dir: str, block_size: int = 16) -> float:
    """Room for every request at its full length at once (no preemption), plus 10%."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    bytes_per_token = 2 * config["num_hidden_layers"] * config["hidden_size"] * 4  # K and V, float32
    max_len = workload.max_prompt_len + workload.max_output_len
    tokens = workload.num_requests * (-(-max_len // block_size)) * block_size
    return round(1.1 * tokens * bytes_per_token / 2**30 + 0.05, 2)


# ---------------------------------------------------------------------------- engine


def make_engine(model_dir: str, threads: int, kv_gb: float, seed: int) -> LLM:
    return LLM(
        model=model_dir,
        dtype="float32",
        device="cpu",
        num_cpu_threads=threads,
        kv_cache_memory_gb=kv_gb,
        enable_prefix_caching=False,  # random prompts share nothing
        seed=seed,
    )


@dataclass(frozen=True, slots=True)
class Timing:
    seconds: float  # wall
    cpu_seconds: float  # this process, all threads


class _Timer:
    def __enter__(self) -> _Timer:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.timing = Timing(time.perf_counter() - self._wall, time.process_time() - self._cpu)


def run_engine(llm: LLM, requests: list[Request]) -> tuple[Timing, list[list[int]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    with _Timer() as timer:
        outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    for r, t in zip(requests, tokens):
        assert len(t) == r.output_len, (len(t), r.output_len)
    return timer.timing, tokens


# ---------------------------------------------------------------------------- HF transformers


def load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def _hf_batch(model, batch: list[Request]) -> list[list[int]]:
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), PAD_TOKEN_ID, dtype=torch.long)  # [batch, width]
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [batch, width]
    for i, r in enumerate(batch):  # left padding
        input_ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        attention_mask[i, width - len(r.prompt_token_ids) :] = 1
    max_new = max(r.output_len for r in batch)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new,
        min_new_tokens=max_new,  # EOS is never chosen (as ignore_eos)
        pad_token_id=PAD_TOKEN_ID,
        use_cache=True,
    )  # [batch, width + max_new]
    return [out[i, width : width + r.output_len].tolist() for i, r in enumerate(batch)]


def run_hf(model, requests: list[Request], batch_size: int) -> tuple[Timing, list[list[int]]]:
    tokens: list[list[int]] = []
    with _Timer() as timer:
        for start in range(0, len(requests), batch_size):
            tokens += _hf_batch(model, requests[start : start + batch_size])
    return timer.timing, tokens


# ---------------------------------------------------------------------------- the run


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Greedy outputs of the two systems: identical requests, and the mean share of each
    request's output that agrees before the first difference (float ties may differ)."""
    same = sum(1 for x, y in zip(a, b) if x == y)
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(k / max(len(x), 1))
    return {"identical_requests": same, "mean_agreeing_prefix": sum(prefix) / len(prefix)}


# Where an engine step's time goes: (label, file suffix, function name); cumulative seconds.
PROFILE_PARTS = (
    ("step (total)", "engine/llm_engine.py", "step"),
    ("model forward", "models/opt.py", "forward"),
    ("  attention (backend forward)", "ops/paged_attention.py", "forward"),
    ("    decode: compiled CPU kernel", "ops/cpu_decode.py", "__call__"),
    ("    decode: torch path", "ops/paged_attention.py", "_torch_decode"),
    ("    prefill attention", "ops/paged_attention.py", "_prefill_attention"),
    ("    write K/V (reshape_and_cache)", "ops/cache_ops.py", "reshape_and_cache"),
    ("  linear layers (torch linear)", "", "<built-in method torch._C._nn.linear>"),
    ("logits (lm head)", "models/opt.py", "compute_logits"),
    ("sampler", "models/sampler.py", "__call__"),
    ("scheduler.schedule", "core/scheduler.py", "schedule"),
    ("model runner prepare", "worker/model_runner.py", "prepare"),
    ("process outputs (incl. detokenize)", "engine/llm_engine.py", "_process"),
)
OUTSIDE_MODEL = "outside the model (step - forward - logits)"


def profile_engine(llm: LLM, requests: list[Request], top: int = 25) -> tuple[str, dict[str, float]]:
    """cProfile of one engine run: the top functions (cumulative, then own time) and a
    summary of where a step's time goes (cumulative seconds, profiler overhead included)."""
    profiler = cProfile.Profile()
    profiler.enable()
    run_engine(llm, requests)
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(15)
    summary = {}
    for label, file_suffix, name in PROFILE_PARTS:
        seconds = [ct for (path, _, func), (_, _, _, ct, _) in stats.stats.items()
                   if func == name and path.endswith(file_suffix)]
        # the outermost entry (the largest cumulative) when a name recurses or repeats
        summary[label] = max(seconds, default=0.0)
    summary[OUTSIDE_MODEL] = summary["step (total)"] - summary["model forward"] - summary["logits (lm head)"]
    return stream.getvalue(), summary


def run(quick: bool, seed: int, threads: int, hf_batch_size: int | None, num_requests: int | None,
        profile_path: str | None, log: Callable[[str], None] = print) -> dict:
    """The uniform case (its figures at the top level) and the equal-length case ("equal_length")."""
    uniform, equal = (QUICK, QUICK_EQUAL) if quick else (FULL, EQUAL)
    if num_requests is not None:
        uniform = Workload(**{**asdict(uniform), "num_requests": num_requests})
    log("uniform lengths:")
    result = run_case(uniform, seed, threads, hf_batch_size, profile_path, log)
    log("equal lengths:")
    result["equal_length"] = run_case(equal, seed, threads, hf_batch_size, None, log, TARGET_RATIO_EQUAL)
    result["quick"] = quick
    return result


def run_case(workload: Workload, seed: int, threads: int, hf_batch_size: int | None, profile_path: str | None,
             log: Callable[[str], None] = print, target_ratio: float = TARGET_RATIO) -> dict:
    loadavg_before = load_average()
    torch.set_num_threads(threads)
    requests = make_requests(workload, seed)
    num_output_tokens = sum(r.output_len for r in requests)
    warmup = make_requests(
        Workload(2, workload.min_prompt_len, workload.min_prompt_len + 8, 4, 4, 2, workload.model), seed + 1
    )
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        model_dir = str(make_tiny_model("opt", os.path.join(tmp, "opt"), **workload.model))
        kv_gb = kv_cache_gb(workload, model_dir)

        # -- HF: sweep batch sizes on the first requests, then all requests with the best
        hf = load_hf(model_dir)
        run_hf(hf, warmup, len(warmup))
        sweep = {}
        if hf_batch_size is None:
            subset = requests[: workload.num_sweep_requests]
            subset_tokens = sum(r.output_len for r in subset)
            for b in HF_BATCH_SIZES:
                if b > len(subset) and sweep:
                    break
                timing, _ = run_hf(hf, subset, b)
                sweep[b] = subset_tokens / timing.seconds
                log(f"  hf sweep: batch {b:3d}: {sweep[b]:8.1f} output tokens/s ({len(subset)} requests)")
            hf_batch_size = max(sweep, key=sweep.get)
        loadavg = {"hf_start": load_average()}
        hf_timing, hf_tokens = run_hf(hf, requests, hf_batch_size)
        loadavg["hf_end"] = load_average()
        log(f"  hf batch {hf_batch_size}: {hf_timing.seconds:.1f} s ({hf_timing.cpu_seconds:.1f} CPU s)")
        del hf

        # -- the engine: every request at once
        llm = make_engine(model_dir, threads, kv_gb, seed)
        if torch.get_num_threads() != threads:
            raise RuntimeError(f"torch threads {torch.get_num_threads()} != {threads}")
        run_engine(llm, warmup)
        loadavg["engine_start"] = load_average()
        engine_timing, engine_tokens = run_engine(llm, requests)
        loadavg["engine_end"] = load_average()
        counters = llm.engine.scheduler.counters
        log(f"  engine: {engine_timing.seconds:.1f} s ({engine_timing.cpu_seconds:.1f} CPU s)")
        profile = profile_summary = None
        if profile_path is not None:
            profile, profile_summary = profile_engine(llm, requests[:NUM_PROFILE_REQUESTS])
            with open(profile_path, "w") as f:
                f.write(profile)
            log(f"  engine profiled (cProfile) -> {profile_path}")
        engine_config = llm.engine.config.model_dump()
        num_gpu_blocks = llm.engine.cache_sizes.num_gpu_blocks

    engine_rate = num_output_tokens / engine_timing.seconds
    hf_rate = num_output_tokens / hf_timing.seconds
    ratio = engine_rate / hf_rate
    return {
        "engine_output_tokens_per_s": engine_rate,
        "hf_output_tokens_per_s": hf_rate,
        "ratio": ratio,
        "ratio_per_cpu_second": hf_timing.cpu_seconds / engine_timing.cpu_seconds,
        "target_ratio": target_ratio,
        "target_met": ratio >= target_ratio,
        "engine_seconds": engine_timing.seconds,
        "hf_seconds": hf_timing.seconds,
        "engine_cpu_seconds": engine_timing.cpu_seconds,
        "hf_cpu_seconds": hf_timing.cpu_seconds,
        "hf_batch_size": hf_batch_size,
        "hf_sweep_output_tokens_per_s": {str(b): v for b, v in sweep.items()},
        "engine_preemptions": counters.preemptions_recompute + counters.preemptions_swap,
        "greedy_agreement": agreement(engine_tokens, hf_tokens),
        "profile": profile,
        "profile_summary_seconds": profile_summary,
        "profile_num_requests": min(NUM_PROFILE_REQUESTS, len(requests)) if profile is not None else None,
        "config": {
            "workload": asdict(workload),
            "num_output_tokens": num_output_tokens,
            "num_prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "length_distribution": "prompt and output lengths uniform on [min, max] inclusive; random token ids",
            "model": {"arch": "opt", "weights": "random (seed 0)", "dtype": "float32",
                      **_model_config(workload)},
            "torch_threads": threads,
            "engine": {**engine_config, "num_gpu_blocks": num_gpu_blocks},
            "hf": {"transformers": _transformers_version(), "decoding": "greedy, min_new_tokens = max_new_tokens",
                   "padding": "left", "order": "request order, static batches"},
            "loadavg_before": loadavg_before,
            "loadavg": loadavg,
        },
        "seed": seed,
    }


def _model_config(workload: Workload) -> dict:
    from rayserve_paged.models.tiny import tiny_config

    config = tiny_config("opt", **workload.model)
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "ffn_dim", "vocab_size",
            "max_position_embeddings", "tie_word_embeddings")
    return {k: config[k] for k in keys}


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def format_report(result: dict) -> str:
    lines = ["== uniform lengths", *format_case(result), "", "== equal lengths", *format_case(result["equal_length"])]
    return "\n".join(lines)


def format_case(result: dict) -> list[str]:
    cfg = result["config"]
    w = cfg["workload"]
    m = cfg["model"]
    lines = [
        f"{w['num_requests']} requests: prompts uniform {w['min_prompt_len']}-{w['max_prompt_len']}, outputs uniform "
        f"{w['min_output_len']}-{w['max_output_len']} tokens ({cfg['num_prompt_tokens']} prompt / "
        f"{cfg['num_output_tokens']} output tokens), greedy, EOS ignored",
        f"OPT, random weights, float32: {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
        f"{m['num_attention_heads']} heads, ffn {m['ffn_dim']}, vocab {m['vocab_size']}; CPU, torch threads "
        f"{cfg['torch_threads']} (both systems)",
        "load average (1/5/15 min): " + ", ".join(f"{k} {v}" for k, v in cfg["loadavg"].items()),
        "",
    ]
    if result["hf_sweep_output_tokens_per_s"]:
        lines.append(
            f"HF batch-size sweep (first {w['num_sweep_requests']} requests), output tokens/s: "
            + ", ".join(f"{b}: {v:.1f}" for b, v in result["hf_sweep_output_tokens_per_s"].items())
        )
        lines.append("")
    header = f"{'system':34s} {'seconds':>8s} {'output tok/s':>13s} | {'CPU s':>8s} {'tok/CPU s':>10s}"
    lines += [header, "-" * len(header)]
    tokens = cfg["num_output_tokens"]
    for name, prefix in (("rayserve-paged (all at once)", "engine"),
                         (f"HF generate (static batch {result['hf_batch_size']})", "hf")):
        wall, cpu = result[f"{prefix}_seconds"], result[f"{prefix}_cpu_seconds"]
        lines.append(f"{name:34s} {wall:8.1f} {tokens / wall:13.1f} | {cpu:8.1f} {tokens / cpu:10.1f}")
    a = result["greedy_agreement"]
    lines += [
        "",
        f"ratio engine / HF: {result['ratio']:.2f}x wall, {result['ratio_per_cpu_second']:.2f}x per CPU second  "
        f"[{'PASS' if result['target_met'] else 'FAIL'}] target >= {result['target_ratio']:g}x (wall)",
        f"engine preemptions: {result['engine_preemptions']}; greedy outputs identical for "
        f"{a['identical_requests']} / {w['num_requests']} requests "
        f"(mean agreeing prefix {a['mean_agreeing_prefix']:.1%})",
    ]
    if result["profile_summary_seconds"]:
        summary = result["profile_summary_seconds"]
        total = summary["step (total)"] or 1.0
        lines += ["", f"engine profile (cProfile, first {result['profile_num_requests']} requests), "
                  "cumulative seconds and share of step time:"]
        lines += [f"  {label:44s} {seconds:8.1f} {seconds / total:7.1%}" for label, seconds in summary.items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench throughput", __doc__.splitlines()[0], out_required=True,
                              out_help="directory for throughput.json", seed=DEFAULT_SEED,
                              quick_help="seconds, for tests (tiny model, a few requests)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"torch intra-op threads for both systems (default {DEFAULT_THREADS})")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"uniform case (default {FULL.num_requests}); the equal-length case keeps its own")
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help=f"skip the sweep over {', '.join(map(str, HF_BATCH_SIZES))}")
    parser.add_argument("--profile", action="store_true",
                        help=f"then run the engine on the first {NUM_PROFILE_REQUESTS} requests under cProfile; "
                        "top functions by cumulative time -> engine_profile.txt")
    args = parser.parse_args(argv)
    if args.num_requests is not None and args.num_requests < 1:
        parser.error("--num-requests must be >= 1")
    if args.threads < 1 or (args.hf_batch_size is not None and args.hf_batch_size < 1):
        parser.error("--threads and --hf-batch-size must be >= 1")
    os.makedirs(args.out, exist_ok=True)
    profile_path = os.path.join(args.out, "engine_profile.txt") if args.profile else None
    result = run(args.quick, args.seed, args.threads, args.hf_batch_size, args.num_requests, profile_path,
                 log=progress)
    write_report(args.out, "throughput.json", result, format_report, *filter(None, [profile_path]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
