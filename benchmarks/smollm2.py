"""SmolLM2-135M-Instruct, the embedded GGUF model: load time, and output tokens/s of this engine
against Hugging Face transformers on the same model and the same chat requests.

    rayserve-paged bench smollm2 --out DIR [--threads 1] [--num-requests 32] [--max-tokens 64]
                                 [--rounds 1] [--no-load] [--no-http]

load     each in a fresh subprocess (nothing cached in memory; the converted tokenizer is on
         disk after the first run): the project's `get_model_config` + `load_model`
         (Q4_1 / Q8_0 dequantized to float32) + `load_tokenizer`, and transformers'
         `AutoTokenizer` + `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`; wall
         seconds and the process's peak RSS.
engine   LLM("smollm2").chat with every request at once.
hf       AutoModelForCausalLM.generate over all requests in one left-padded batch.
http     `serve run` of configs/smollm2.yaml with one fixed replica (no autoscaling: a second
         replica loading mid-run would take the CPUs), the requests sent at once to
         /v1/chat/completions with httpx; the model behind it is the engine's.

Requests: NUM_REQUESTS different one-turn chat questions through the model's chat template,
greedy, exactly max_tokens output tokens each (engine and HTTP: ignore_eos; HF:
min_new_tokens = max_new_tokens), float32 on CPU, the same torch intra-op threads for both.
Output tokens/s = requests x max_tokens / wall seconds of the generate call, after one untimed
warm-up call each. The engine runs before and after HF, and with --rounds N the pair
(HF, engine) N times (the machine is shared: the interleaving shows how much its load moved).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.options import add_engine_run_arguments, benchmark_parser
from benchmarks.records import load_average, write_report

SUBJECTS = [
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Norway",
    "the Moon", "volcanoes", "honey bees", "rainbows", "the ocean", "tea", "bicycles", "penguins",
]  # fmt: skip
NUM_REQUESTS = 32
MAX_TOKENS = 64
DEFAULT_THREADS = 1  # robust on a shared CPU: a descheduled second thread stalls every op
# the float32 path, as transformers runs it (`bench quantized` measures the quantized one)
ENGINE_OPTIONS = {"device": "cpu", "dtype": "float32", "quantization": "none", "max_model_len": 512,
                  "kv_cache_memory_gb": 0.25}  # fmt: skip


def questions(num: int) -> list[str]:
    """num distinct short questions: two kinds per subject, then numbered repeats."""
    kinds = ["Tell me one interesting fact about {}.", "Describe {} in two sentences."]
    base = [kind.format(subject) for subject in SUBJECTS for kind in kinds]
    return [base[i % len(base)] + ("" if i < len(base) else f" (#{i // len(base)})") for i in range(num)]


def conversations(num: int) -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in questions(num)]


# --------------------------------------------------------------------------- load


def measure_load(which: str) -> dict:
    """Runs in a fresh subprocess: wall seconds and peak RSS of one load."""
    from rayserve_paged.models.loader import peak_rss_bytes

    start = time.perf_counter()
    if which == "project":
        from rayserve_paged.models.loader import get_model_config, load_model, load_tokenizer
        from rayserve_paged.models.tiny import resolve_model

        path = resolve_model("smollm2")
        get_model_config(path)
        load_model(path, dtype=torch.float32, quantization="none")
        load_tokenizer(path)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rayserve_paged.models.tiny import resolve_model

        path = resolve_model("smollm2")
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return {"seconds": time.perf_counter() - start, "peak_rss_gib": peak_rss_bytes() / 2**30}


def _load_in_subprocess(which: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.smollm2", "--measure-load", which],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- generation


def run_engine(llm, convs: list[list[dict]], max_tokens: int) -> dict:
    from rayserve_paged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(convs[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.chat(convs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "first_answer": outputs[0].outputs[0].text}  # fmt: skip


def run_hf(model, tokenizer, convs: list[list[dict]], max_tokens: int) -> dict:
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.generate(**tokenizer(texts[:1], return_tensors="pt", add_special_tokens=False), max_new_tokens=4, **kwargs)
        start = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
        seconds = time.perf_counter() - start
    new = out[:, batch["input_ids"].shape[1] :]
    tokens = new.numel()
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "first_answer": tokenizer.decode(new[0], skip_special_tokens=True)}  # fmt: skip


async def post_chats(
    base_url: str, convs: list[list[dict]], max_tokens: int, model: str = "smollm2"
) -> tuple[float, int]:
    """Every conversation at once as a greedy chat completion (after one warm-up request):
    (seconds, output tokens)."""
    import httpx

    body = {"model": model, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=1800, trust_env=False, limits=httpx.Limits(max_connections=256)) as client:
        url = f"{base_url}/v1/chat/completions"
        (await client.post(url, json={**body, "messages": convs[0], "max_tokens": 4})).raise_for_status()  # warm-up
        start = time.perf_counter()
        replies = await asyncio.gather(
            *[client.post(url, json={**body, "messages": c, "max_tokens": max_tokens}) for c in convs]
        )
        seconds = time.perf_counter() - start
    for r in replies:
        r.raise_for_status()
    return seconds, sum(r.json()["usage"]["completion_tokens"] for r in replies)


def run_http(convs: list[list[dict]], max_tokens: int, threads: int, log_dir: Path) -> dict:
    import yaml

    from benchmarks.serving import LaunchedServer

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml").read_text())
    args = config["applications"][0]["args"]
    args.pop("autoscaling_config", None)
    args |= {"num_replicas": 1, "num_cpu_threads": threads, "max_model_len": ENGINE_OPTIONS["max_model_len"],
             "quantization": ENGINE_OPTIONS["quantization"]}
    with LaunchedServer(config, log_dir) as server:
        start = time.perf_counter()
        server.start(timeout_s=1200, log=lambda message: None)
        startup = time.perf_counter() - start
        seconds, tokens = asyncio.run(post_chats(server.base_url, convs, max_tokens))
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds, "startup_s": startup}


def run(num_requests: int, max_tokens: int, threads: int, rounds: int, load: bool, http: bool, out_dir: Path,
        log=print) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayserve_paged import LLM
    from rayserve_paged.models.tiny import resolve_model

    result = {"threads": threads, "num_requests": num_requests, "max_tokens": max_tokens,
              "loadavg_start": load_average()}  # fmt: skip
    if load:
        log("load: project")
        result["load_project"] = _load_in_subprocess("project", threads)
        log("load: transformers")
        result["load_hf"] = _load_in_subprocess("hf", threads)
    torch.set_num_threads(threads)
    convs = conversations(num_requests)
    llm = LLM("smollm2", num_cpu_threads=threads, **ENGINE_OPTIONS)
    log("engine")
    result["engine"] = [run_engine(llm, convs, max_tokens)]
    path = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    result["hf"] = []
    for i in range(rounds):
        log(f"hf, engine ({i + 1} of {rounds})")
        result["hf"].append(run_hf(model, tokenizer, convs, max_tokens))
        result["engine"].append(run_engine(llm, convs, max_tokens))
    del llm, model
    result["engine_over_hf"] = _mean(result["engine"]) / _mean(result["hf"])
    if http:
        log("http")
        result["http"] = run_http(convs, max_tokens, threads, out_dir / "http-logs")
        result["http_over_hf"] = result["http"]["tokens_per_s"] / _mean(result["hf"])
    result["loadavg_end"] = load_average()
    return result


def _mean(runs: list[dict]) -> float:
    return sum(run["tokens_per_s"] for run in runs) / len(runs)


def format_report(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"SmolLM2-135M-Instruct Q4_1 GGUF, float32 CPU, {r['threads']} torch thread(s); {m['cpu']}, "
        f"{m['cpu_count']} CPUs, torch {m['versions'].get('torch')}",
        f"load average start {r['loadavg_start']}, end {r['loadavg_end']}",
    ]
    if "load_project" in r:
        lines.append(
            f"load (fresh process): project {r['load_project']['seconds']:.1f} s, peak RSS "
            f"{r['load_project']['peak_rss_gib']:.2f} GiB; transformers {r['load_hf']['seconds']:.1f} s, "
            f"peak RSS {r['load_hf']['peak_rss_gib']:.2f} GiB"
        )
    lines.append(f"{r['num_requests']} chat requests x {r['max_tokens']} output tokens, greedy (in run order):")
    order = [("engine", r["engine"][0])]
    for hf, engine in zip(r["hf"], r["engine"][1:]):
        order += [("hf", hf), ("engine", engine)]
    order += [("http", r["http"])] if "http" in r else []
    for name, run in order:
        lines.append(f"  {name:7s} {run['tokens_per_s']:8.1f} output tokens/s ({run['seconds']:.1f} s)")
    lines.append(f"  engine / hf = {r['engine_over_hf']:.2f}x" + (
        f"; http / hf = {r['http_over_hf']:.2f}x" if "http" in r else ""))  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench smollm2", __doc__.splitlines()[0], seed=None,
                              out_help="directory for smollm2.json",
                              quick_help="2 requests of 8 tokens, no load-time or HTTP run (seconds)")
    add_engine_run_arguments(parser, threads=DEFAULT_THREADS, num_requests=NUM_REQUESTS, max_tokens=MAX_TOKENS,
                             rounds_help="(HF, engine) pairs after the first engine run")
    parser.add_argument("--no-load", action="store_true", help="skip the load-time measurement")
    parser.add_argument("--no-http", action="store_true", help="skip the run over HTTP")
    parser.add_argument("--measure-load", choices=["project", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_load:
        print(json.dumps(measure_load(args.measure_load)))
        return 0
    if not args.out:
        parser.error("--out is required")
    if args.quick:
        args.num_requests, args.max_tokens, args.no_load, args.no_http = 2, 8, True, True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if min(args.rounds, args.num_requests, args.max_tokens, args.threads) < 1:
        parser.error("--rounds, --num-requests, --max-tokens and --threads must be >= 1")
    result = run(args.num_requests, args.max_tokens, args.threads, args.rounds, not args.no_load, not args.no_http, out,
                 log=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
    write_report(out, "smollm2.json", result, format_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
