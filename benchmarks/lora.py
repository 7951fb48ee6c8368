"""Multi-LoRA throughput on CPU: one engine, a 64-request batch spread over 0, 1, 4 and 16
distinct rank-16 adapters, in one sitting; the time to load an adapter from disk; a running
stream's inter-token gaps while a ~100 MB adapter loads; base-only decode speed of a
LoRA-enabled engine.

    rayserve-paged bench lora --out DIR [--quick] [--threads N] [--repeats R] [--before DIR] [--no-batch]

Model: the throughput benchmark's random-weight OPT (6 layers, hidden 512, 8 heads, ffn
2048, the tiny 512-token vocabulary), float32. Adapters: PEFT-format directories written
here with random A and B (rank 16, lora_alpha 32) on every projection (q, k, v, out_proj,
fc1, fc2) of every layer.

Each case runs the same 64 requests (random prompts of 64 tokens, 64 output tokens each,
greedy, EOS ignored) through one engine (max_loras 16, max_lora_rank 16, so every adapter
stays resident once loaded: the timed runs measure the batched compute, not loading);
request i runs on adapter i mod k (k = 0: the base model). One untimed warm-up call per
case first (which also loads its adapters into their slots); then `--repeats` timed calls,
the median reported. Output tokens per second = 64 x 64 / wall seconds of the call; per CPU second (this
process, all threads) beside it, the steadier figure on a shared machine.

Load time: per adapter, reading and checking the directory and cutting it into the slot
layout (models/lora.py read_peft_adapter + shard_adapter, what a worker does on a CPU-cache
miss), and the engine's registration check against the model's skeleton (LLMEngine.add_lora),
each the median over the 16 adapters.

Load gap (`load_gap`): a SchedulerActor (in-process executor, its step thread) on a 42-layer
random OPT (hidden 512, ffn 2048; 132M parameters) streams one request (16 prompt tokens,
300 greedy output tokens); after 20 tokens a rank-64 adapter on every projection of every
layer (99 MB of safetensors) is loaded through SchedulerActor.load_lora, as
POST /v1/load_lora_adapter does. The stream's gaps between consecutive tokens: p50 / p99 /
max before the load, and p99 / max of those that overlap the load.

Base decode (`base_decode`): SmolLM2-135M (the packaged GGUF, `quantization: auto`), one
stream at a time (16 prompt tokens, 64 greedy output tokens, 3 timed requests after a
warm-up), output tokens/s of an engine with LoRA off and with LoRA enabled (no request
naming an adapter); the compiled CPU decode layer runs in both when this CPU has AVX-512.

With --before DIR (a source tree of an earlier version, e.g. `git archive`d), the load gap
and base decode cases also run from that tree's package, first, each in its own process.
--no-batch runs only those two cases.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.records import load_average, write_json
from rayserve_paged import LLM, LoRARequest, SamplingParams
from rayserve_paged.models.tiny import SPECIAL_TOKENS, TINY_VOCAB_SIZE, make_tiny_model

DEFAULT_THREADS = 1  # robust on a shared CPU (benchmarks/throughput.py)
RANK, ALPHA = 16, 32
OPT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
CASES = (0, 1, 4, 16)  # distinct adapters in the batch
TARGET_RATIO = 0.8  # 4 adapters against the base model
FULL = dict(
    num_requests=64, prompt_len=64, output_len=64,
    model={"num_hidden_layers": 6, "hidden_size": 512, "word_embed_proj_dim": 512, "num_attention_heads": 8,
           "ffn_dim": 2048, "vocab_size": TINY_VOCAB_SIZE, "max_position_embeddings": 2048},
)  # fmt: skip
QUICK = dict(num_requests=8, prompt_len=8, output_len=6, model={})  # the default tiny OPT


def write_random_adapter(model_dir: str | Path, out_dir: str | Path, rank: int, alpha: float,
                         targets: tuple[str, ...], seed: int) -> Path:  # fmt: skip
    """A PEFT LoRA directory for the checkpoint in model_dir: A [r, in] and B [out, r] drawn
    at random for every 2-d weight whose module is in `targets` (names as the checkpoint's)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        for name in f.keys():
            module, _, leaf = name.rpartition(".")
            if leaf != "weight" or module.rpartition(".")[2] not in targets:
                continue
            out_features, in_features = f.get_slice(name).get_shape()
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) / rank**0.5
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def make_prompts(num_requests: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(f"lora-{seed}")
    first = len(SPECIAL_TOKENS)
    return [[rng.randrange(first, TINY_VOCAB_SIZE) for _ in range(prompt_len)] for _ in range(num_requests)]


def run_case(llm: LLM, prompts, output_len: int, loras: list[LoRARequest], repeats: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    per_request = [loras[i % len(loras)] if loras else None for i in range(len(prompts))]
    llm.generate(prompts, params, lora_request=per_request, use_tqdm=False)  # warm-up; loads the slots
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, lora_request=per_request, use_tqdm=False)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    tokens = len(prompts) * output_len
    wall = statistics.median(walls)
    return {
        "num_adapters": len(loras), "seconds": walls, "cpu_seconds": cpus, "median_seconds": wall,
        "output_tokens_per_s": tokens / wall, "output_tokens_per_cpu_s": tokens / statistics.median(cpus),
    }  # fmt: skip


def load_times(llm: LLM, model_dir: str, adapter_dirs: list[Path]) -> dict:
    from rayserve_paged.models.loader import load_model
    from rayserve_paged.models.lora import read_peft_adapter, shard_adapter

    model = load_model(model_dir, torch.float32)
    read, register = [], []
    for i, path in enumerate(adapter_dirs):
        start = time.perf_counter()
        shard_adapter(model, read_peft_adapter(path, RANK), RANK)
        read.append(time.perf_counter() - start)
        start = time.perf_counter()
        llm.engine.add_lora(LoRARequest(f"load-{i}", 1000 + i, str(path)))
        register.append(time.perf_counter() - start)
    size = (adapter_dirs[0] / "adapter_model.safetensors").stat().st_size
    return {
        "adapter_bytes": size, "read_and_shard_ms": [t * 1e3 for t in read], "register_ms": [t * 1e3 for t in register],
        "median_read_and_shard_ms": statistics.median(read) * 1e3, "median_register_ms": statistics.median(register) * 1e3,
    }  # fmt: skip


def run(quick: bool, threads: int, repeats: int, log=print) -> dict:
    w = QUICK if quick else FULL
    loadavg_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model("opt", Path(tmp) / "opt", **w["model"]))
        num_adapters = 2 if quick else max(CASES)
        dirs = [write_random_adapter(model_dir, Path(tmp) / f"lora-{i}", RANK, ALPHA, OPT_TARGETS, seed=i)
                for i in range(num_adapters)]  # fmt: skip
        llm = LLM(
            model=model_dir, dtype="float32", device="cpu", num_cpu_threads=threads, kv_cache_memory_gb=0.5,
            enable_prefix_caching=False, max_num_seqs=w["num_requests"], enable_lora=True, max_loras=num_adapters,
            max_lora_rank=RANK, max_cpu_loras=2 * num_adapters, **_load_root(tmp),
        )  # fmt: skip
        loras = [llm.engine.load_lora(f"adapter-{i}", str(d)) for i, d in enumerate(dirs)]
        prompts = make_prompts(w["num_requests"], w["prompt_len"])
        cases = {}
        for k in (0, 1, 2) if quick else CASES:
            log(f"{k} adapters ...")
            cases[str(k)] = run_case(llm, prompts, w["output_len"], loras[:k], repeats)
        loads = load_times(llm, model_dir, dirs)
        slots = llm.engine.lora_slots.counters
    base = cases["0"]["output_tokens_per_s"]
    ratios = {k: c["output_tokens_per_s"] / base for k, c in cases.items()}
    base_cpu = cases["0"]["output_tokens_per_cpu_s"]
    cpu_ratios = {k: c["output_tokens_per_cpu_s"] / base_cpu for k, c in cases.items()}
    four = ratios.get("4")
    return {
        "quick": quick, "workload": {k: v for k, v in w.items() if k != "model"}, "model": w["model"] or "tiny OPT",
        "rank": RANK, "lora_alpha": ALPHA, "targets": list(OPT_TARGETS), "torch_threads": threads,
        "repeats": repeats, "cases": cases, "ratio_to_base": ratios, "ratio_to_base_per_cpu_s": cpu_ratios,
        "target_ratio": TARGET_RATIO, "target_met": None if four is None else four >= TARGET_RATIO,
        "slot_loads": slots.num_loads, "slot_evictions": slots.num_evictions, "load": loads,
        "loadavg_before": loadavg_before, "loadavg_after": load_average(),
    }  # fmt: skip


# --------------------------------------------------------------------------- load gap, base decode

GAP_FULL = dict(
    output_len=300, warm_tokens=20, rank=64,
    model={"num_hidden_layers": 42, "hidden_size": 512, "word_embed_proj_dim": 512, "num_attention_heads": 8,
           "ffn_dim": 2048, "vocab_size": TINY_VOCAB_SIZE, "max_position_embeddings": 2048},
)  # fmt: skip
GAP_QUICK = dict(output_len=40, warm_tokens=5, rank=8, model={})
DECODE_REQUESTS, DECODE_PROMPT, DECODE_TOKENS = 3, 16, 64


def _load_root(root) -> dict:
    """lora_modules_root where the version has it (runtime loads need one since it came in)."""
    from rayserve_paged.config import EngineConfig

    return {"lora_modules_root": [str(root)]} if "lora_modules_root" in EngineConfig.model_fields else {}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure_load_gap(quick: bool, threads: int) -> dict:
    from rayserve_paged.config import EngineConfig
    from rayserve_paged.engine.scheduler_actor import SchedulerActor

    w = GAP_QUICK if quick else GAP_FULL
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model("opt", Path(tmp) / "opt", **w["model"]))
        adapter = write_random_adapter(model_dir, Path(tmp) / "big", w["rank"], 2 * w["rank"], OPT_TARGETS, seed=7)
        size = (adapter / "adapter_model.safetensors").stat().st_size
        config = EngineConfig(
            model=model_dir, dtype="float32", device="cpu", num_cpu_threads=threads, kv_cache_memory_gb=0.2,
            max_model_len=512, swap_space_gb=0.01, enable_lora=True, max_lora_rank=w["rank"], **_load_root(tmp),
        )  # fmt: skip
        actor = SchedulerActor(config, executor="in-process")
        try:
            stamps, load = asyncio.run(_stream_while_loading(actor, str(adapter), w["output_len"], w["warm_tokens"]))
        finally:
            actor.shutdown()
    gaps = [(b - a, a, b) for a, b in zip(stamps, stamps[1:])]
    before = [g for g, _, end in gaps if end <= load[0]]
    during = [g for g, start, end in gaps if end > load[0] and start < load[1]]
    return {
        "adapter_mib": size / 2**20, "rank": w["rank"], "num_layers": w["model"].get("num_hidden_layers"),
        "output_tokens": len(stamps), "load_s": load[1] - load[0], "num_gaps_during_load": len(during),
        "gap_ms_before": {"p50": _percentile(before, 0.5) * 1e3, "p99": _percentile(before, 0.99) * 1e3,
                          "max": max(before) * 1e3},
        "gap_ms_during_load": {"p99": (_percentile(during, 0.99) or 0) * 1e3, "max": max(during, default=0) * 1e3},
    }  # fmt: skip


async def _stream_while_loading(actor, adapter: str, output_len: int, warm_tokens: int):
    """Times of the stream's tokens, and (start, end) of the adapter's load."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    stamps: list[float] = []

    async def consume():
        async for batch in actor.outputs():
            now = time.perf_counter()
            for out in batch:
                stamps.extend([now] * sum(len(d.token_ids) for d in out.outputs))
                if out.finished:
                    return

    consumer = asyncio.ensure_future(consume())
    await actor.add_request("stream", None, make_prompts(1, 16)[0], params)
    while len(stamps) < warm_tokens:
        await asyncio.sleep(0.005)
    start = time.perf_counter()
    await actor.load_lora("big", adapter)
    end = time.perf_counter()
    await consumer
    return stamps, (start, end)


def measure_base_decode(quick: bool, threads: int) -> dict:
    model = "tiny-llama" if quick else "smollm2"
    result = {"model": model}
    prompts = make_prompts(DECODE_REQUESTS, DECODE_PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=4 if quick else DECODE_TOKENS, ignore_eos=True)
    for case, lora in (("lora_off", {}), ("lora_on", {"enable_lora": True})):
        llm = LLM(model, num_cpu_threads=threads, max_model_len=512, kv_cache_memory_gb=0.1, swap_space_gb=0.01,
                  **({} if quick else {"quantization": "auto"}), **lora)  # fmt: skip
        llm.generate([prompts[0]], params, use_tqdm=False)  # warm-up
        wall, cpu, tokens = 0.0, 0.0, 0
        for prompt in prompts:  # one stream at a time
            start, cpu_start = time.perf_counter(), time.process_time()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            wall, cpu = wall + time.perf_counter() - start, cpu + time.process_time() - cpu_start
            tokens += len(out.outputs[0].token_ids)
        result[case] = {"output_tokens_per_s": tokens / wall, "output_tokens_per_cpu_s": tokens / cpu}
        del llm
    return result


def run_child(case: str, quick: bool, threads: int, source: str | None) -> dict:
    """A case in a fresh process, from `source`'s package (None: this one's)."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if source is not None:
        env["PYTHONPATH"] = str(Path(source).resolve())
    args = [sys.executable, str(Path(__file__).resolve()), "--child", case, "--threads", str(threads), "--out", "-"]
    out = subprocess.run(args + (["--quick"] if quick else []), env=env, capture_output=True, text=True, check=True,
                         cwd=source)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_lifecycle_cases(quick: bool, threads: int, before: str | None, log=print) -> dict:
    """load_gap and base_decode, each version in its own process (the earlier one first)."""
    results = {}
    for case in ("load_gap", "base_decode"):
        for version, source in (("before", before), ("after", None)):
            if version == "before" and source is None:
                continue
            log(f"{case} ({version}) ...")
            if quick and source is None:  # seconds, for tests: in this process
                measure = measure_load_gap if case == "load_gap" else measure_base_decode
                results.setdefault(case, {})[version] = measure(quick, threads)
            else:  # each version in a fresh process of its own
                results.setdefault(case, {})[version] = run_child(case, quick, threads, source)
    return results


def _batch_lines(result: dict) -> list[str]:
    w = result["workload"]
    lines = [
        f"{w['num_requests']} requests x ({w['prompt_len']} prompt + {w['output_len']} output tokens), greedy; "
        f"adapters rank {result['rank']} on {', '.join(result['targets'])}; torch threads {result['torch_threads']}; "
        f"median of {result['repeats']}",
        f"load average before {tuple(round(x, 2) for x in result['loadavg_before'])}, "
        f"after {tuple(round(x, 2) for x in result['loadavg_after'])}",
        "",
        f"{'adapters':>8s} {'seconds':>8s} {'output tok/s':>13s} {'vs base':>8s} | {'tok/CPU s':>10s} {'vs base':>8s}",
    ]
    for k, c in result["cases"].items():
        lines.append(f"{k:>8s} {c['median_seconds']:8.2f} {c['output_tokens_per_s']:13.1f} "
                     f"{result['ratio_to_base'][k]:7.2f}x | {c['output_tokens_per_cpu_s']:10.1f} "
                     f"{result['ratio_to_base_per_cpu_s'][k]:7.2f}x")  # fmt: skip
    if result["target_met"] is not None:
        lines.append(f"4 adapters / base: {result['ratio_to_base']['4']:.2f}x "
                     f"[{'PASS' if result['target_met'] else 'FAIL'}] target >= {result['target_ratio']}x")  # fmt: skip
    load = result["load"]
    lines += [
        "",
        f"adapter load ({load['adapter_bytes'] / 2**20:.1f} MiB safetensors): read + check + shard "
        f"{load['median_read_and_shard_ms']:.1f} ms, engine registration check {load['median_register_ms']:.1f} ms "
        "(medians)",
    ]
    return lines


def format_report(result: dict) -> str:
    lines = [] if "cases" not in result else _batch_lines(result)
    if not lines:
        lines.append(f"load average before {tuple(round(x, 2) for x in result['loadavg_before'])}, "
                     f"after {tuple(round(x, 2) for x in result['loadavg_after'])}")  # fmt: skip
    for version, gap in result.get("load_gap", {}).items():
        b, d = gap["gap_ms_before"], gap["gap_ms_during_load"]
        lines.append(
            f"load gap ({version}): {gap['adapter_mib']:.0f} MiB adapter loaded in {gap['load_s']:.2f} s; stream gaps "
            f"before p50 {b['p50']:.1f} / p99 {b['p99']:.1f} ms; during the load p99 {d['p99']:.1f} / max "
            f"{d['max']:.1f} ms ({gap['num_gaps_during_load']} gaps)"
        )
    for version, dec in result.get("base_decode", {}).items():
        off, on = dec["lora_off"]["output_tokens_per_s"], dec["lora_on"]["output_tokens_per_s"]
        off_cpu, on_cpu = dec["lora_off"]["output_tokens_per_cpu_s"], dec["lora_on"]["output_tokens_per_cpu_s"]
        lines.append(f"base decode ({version}, {dec['model']}): LoRA off {off:.1f} tok/s, LoRA enabled {on:.1f} tok/s "
                     f"({on / off:.2f}x); per CPU second {off_cpu:.1f} / {on_cpu:.1f} ({on_cpu / off_cpu:.2f}x)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayserve-paged bench lora", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for lora.json")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="seconds, for tests (tiny model, a few requests)")
    parser.add_argument("--before", help="a source tree of an earlier version: its load gap and base decode too")
    parser.add_argument("--no-batch", action="store_true", help="only the load-gap and base-decode cases")
    parser.add_argument("--child", choices=["load_gap", "base_decode"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        parser.error("--threads and --repeats must be >= 1")
    if args.child is not None:
        measure = measure_load_gap if args.child == "load_gap" else measure_base_decode
        print(json.dumps(measure(args.quick, args.threads)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    result = {"loadavg_before": load_average()} if args.no_batch else run(args.quick, args.threads, args.repeats, log=log)
    result |= run_lifecycle_cases(args.quick, args.threads, args.before, log=log)
    result["loadavg_after"] = load_average()
    path = write_json(args.out, "lora.json", result)  # with the machine record (platform, CPU, versions)
    print(format_report(result))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
