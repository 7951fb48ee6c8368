"""Multi-LoRA throughput on CPU: one engine, a 64-request batch spread over 0, 1, 4 and 16
distinct rank-16 adapters, in one sitting; and the time to load an adapter from disk.

    rayserve-paged bench lora --out DIR [--quick] [--threads N] [--repeats R]

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
"""

from __future__ import annotations

import argparse
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
            max_lora_rank=RANK,
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


def format_report(result: dict) -> str:
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayserve-paged bench lora", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for lora.json")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="seconds, for tests (tiny model, a few requests)")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        parser.error("--threads and --repeats must be >= 1")
    os.makedirs(args.out, exist_ok=True)
    result = run(args.quick, args.threads, args.repeats, log=lambda m: print(m, file=sys.stderr))
    path = write_json(args.out, "lora.json", result)  # with the machine record (platform, CPU, versions)
    print(format_report(result))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
