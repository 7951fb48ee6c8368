"""SmolLM2-135M-Instruct with its weights kept quantized (`quantization: auto`) against the float32
dequantized path (`quantization: none`), in one sitting; over HTTP, `serve run configs/smollm2.yaml`
and, when its path is given, llama.cpp's llama-server on the same GGUF file.

    rayserve-paged bench quantized --out DIR [--threads 1] [--num-requests 32] [--max-tokens 64]
                                   [--rounds 1] [--no-kernels] [--no-http] [--llama-server PATH]
                                   [--before DIR] [--layouts 1x2,2x1]

kernels    the four projections of SmolLM2's 30 layers (qkv 960x576, o 576x576, gate|up 3072x576,
           down 576x1536; 30 copies of each, so the weights stream from memory as in a decode
           step) for 1..32 rows: float32 and bfloat16 F.linear, torch's packed int4 kernel with
           one and with two (head + rest) scale terms, the compiled float32 kernel
           (ops/quant_cpu.py, when it builds; also its build without AVX-512, what an AVX2
           laptop compiles); milliseconds per 30 layers. And the LM head
           (49152x576): float32 F.linear against the compiled kernel on 8-bit codes.
load       each quantization in a fresh subprocess: `load_model` alone, seconds and peak RSS.
engine     each quantization in a fresh subprocess, (none, auto) `--rounds` times interleaved:
           `LLM("smollm2")` construction (model, tokenizer, KV cache) in seconds; one chat request
           alone (single stream) and num_requests at once, each exactly max_tokens greedy tokens
           (ignore_eos), output tokens/s after an untimed warm-up, and tokens per second of the
           process's CPU time (what a shared machine's other work does not take away); the
           process's peak RSS.
           With --before DIR (a source tree of an earlier version, e.g. `git archive`d), its
           engine runs too, first in each round, from its own code (the figures "before").
agreement  the greedy tokens of the num_requests chats (the last round), quantized against
           float32: sequences identical, and the tokens before the first difference.
http       one replica of configs/smollm2.yaml (no autoscaling) with --threads torch threads
           and quantization none, then auto (the config's); then each --layouts
           REPLICASxTHREADS (quantization auto); then llama-server when given
           (-np num_requests, one slot per request, the same threads): the same chats sent one
           alone, then all at once, to /v1/chat/completions; completion tokens/s; the RSS of
           each SchedulerActor (the model process) after the load.
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

from benchmarks.options import add_engine_run_arguments
from benchmarks.records import write_record
from benchmarks.smollm2 import conversations, post_chats

NUM_REQUESTS = 32
MAX_TOKENS = 64
DEFAULT_THREADS = 1
QUANTIZATIONS = ("none", "auto")
ENGINE_OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "kv_cache_memory_gb": 0.25,
                  "swap_space_gb": 0.1}  # fmt: skip
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2's per-layer projections [out, in]
KERNEL_ROWS = (1, 2, 4, 8, 16, 32)


# --------------------------------------------------------------------------- kernels


def _timed_ms(cases: dict, totals: dict, repeats: int) -> None:
    for name, run in cases.items():
        run()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        totals[name] = totals.get(name, 0.0) + (time.perf_counter() - start) / repeats * 1e3


def measure_kernels(threads: int, num_layers: int = 30, repeats: int = 5) -> dict:
    import torch.nn.functional as F

    from rayserve_paged.ops import quant_cpu

    torch.set_num_threads(threads)
    kernel = quant_cpu.load()
    portable = quant_cpu.load(("-mno-avx512f",))  # the build a CPU without AVX-512 gets (AVX2 laptops)
    group = 32
    results = {}
    for rows in KERNEL_ROWS:
        totals: dict[str, float] = {}
        for out_features, in_features in SHAPES:
            weights = [torch.randn(out_features, in_features) for _ in range(num_layers)]
            bf16 = [w.bfloat16() for w in weights]
            packed = [
                torch._convert_weight_to_int4pack_for_cpu(
                    torch.randint(0, 16, (out_features, in_features), dtype=torch.int32), 1)
                for _ in range(num_layers)
            ]  # fmt: skip
            sz = torch.rand(in_features // group, out_features, 2).bfloat16()
            compiled = [
                quant_cpu.pack(torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8),
                               torch.rand(out_features, in_features // group), torch.rand(out_features, in_features // group), 4)
                for _ in range(num_layers)
            ] if kernel is not None or portable is not None else []  # fmt: skip
            x = torch.randn(rows, in_features)
            xb = x.bfloat16()
            cases = {
                "float32": lambda: [F.linear(x, w) for w in weights],
                "bfloat16": lambda: [F.linear(xb, w) for w in bf16],
                "int4": lambda: [torch._weight_int4pack_mm_for_cpu(xb, p, group, sz) for p in packed],
                "int4_two_terms": lambda: [
                    torch._weight_int4pack_mm_for_cpu(xb, p, group, sz) + torch._weight_int4pack_mm_for_cpu(xb, p, group, sz)
                    for p in packed
                ],
            }  # fmt: skip
            if kernel is not None:
                cases["compiled"] = lambda: [kernel(x, w) for w in compiled]
            if portable is not None:
                cases["compiled_no_avx512"] = lambda: [portable(x, w) for w in compiled]
            _timed_ms(cases, totals, repeats)
        results[rows] = totals
    if kernel is not None:
        vocab, dim = 49152, 576
        table = torch.randn(vocab, dim)
        codes = quant_cpu.pack(torch.randint(0, 256, (vocab, dim), dtype=torch.uint8), torch.rand(vocab, dim // group),
                               torch.rand(vocab, dim // group), 8)  # fmt: skip
        for rows in KERNEL_ROWS:
            x = torch.randn(rows, dim)
            totals = {}
            _timed_ms({"float32": lambda: F.linear(x, table), "compiled_q8": lambda: kernel(x, codes)}, totals, repeats)
            results[f"lm_head_{rows}"] = totals
    return results


# --------------------------------------------------------------------------- engine


def measure_engine(quantization: str, threads: int, num_requests: int, max_tokens: int, load_only: bool) -> dict:
    """Runs in a fresh subprocess (--engine-child): `load_model` alone, or the engine."""
    from rayserve_paged import LLM, SamplingParams
    from rayserve_paged.models.loader import load_model, peak_rss_bytes
    from rayserve_paged.models.tiny import resolve_model

    torch.set_num_threads(threads)
    start = time.perf_counter()
    if load_only:
        load_model(resolve_model("smollm2"), dtype=torch.float32, quantization=quantization)
        return {"load_model_s": time.perf_counter() - start, "peak_rss_gib": peak_rss_bytes() / 2**30}
    llm = LLM("smollm2", num_cpu_threads=threads, quantization=quantization, **ENGINE_OPTIONS)
    construct_s = time.perf_counter() - start
    convs = conversations(num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(convs[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    result = {"quantization": quantization, "llm_construct_s": construct_s}
    for name, batch in (("single", convs[:1]), ("concurrent", convs)):
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.chat(batch, params, use_tqdm=False)
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result[name] = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                        "cpu_s": cpu_s, "tokens_per_cpu_s": tokens / cpu_s}  # fmt: skip
        if name == "concurrent":
            result["token_ids"] = [o.outputs[0].token_ids for o in outputs]
    result["peak_rss_gib"] = peak_rss_bytes() / 2**30
    return result


def _engine_in_subprocess(quantization: str, threads: int, num_requests: int, max_tokens: int,
                          load_only: bool = False, source: str | None = None) -> dict:
    """The engine child in a fresh process; `source`: another version's source tree, whose
    own code (and benchmark) runs."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if source is not None:
        env["PYTHONPATH"] = str(Path(source).resolve())
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.quantized", "--engine-child", quantization, "--threads", str(threads),
         "--num-requests", str(num_requests), "--max-tokens", str(max_tokens)] + (["--load-only"] if load_only else []),
        env=env, capture_output=True, text=True, check=True, cwd=source,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result | {"version": "before"} if source is not None else result


def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    prefixes = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w))) for g, w in zip(got, want)]
    return {
        "num_identical": sum(g == w for g, w in zip(got, want)),
        "num_sequences": len(want),
        "agreeing_prefix_tokens": prefixes,
        "mean_agreeing_prefix": sum(prefixes) / len(prefixes),
        "tokens_before_first_difference_share": sum(prefixes) / sum(len(w) for w in want),
    }


# --------------------------------------------------------------------------- http


async def _chat_all(base_url: str, model: str, convs: list[list[dict]], max_tokens: int) -> dict:
    seconds, tokens = await post_chats(base_url, convs, max_tokens, model)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}


def _chat_runs(base_url: str, model: str, convs: list[list[dict]], max_tokens: int) -> dict:
    return {
        "single": asyncio.run(_chat_all(base_url, model, convs[:1], max_tokens)),
        "concurrent": asyncio.run(_chat_all(base_url, model, convs, max_tokens)),
    }


def _tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (ps), MiB."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,rss="], capture_output=True, text=True, check=True).stdout
    rows = [tuple(int(v) for v in line.split()) for line in out.splitlines() if line.strip()]
    children: dict[int, list[int]] = {}
    for child, parent, _ in rows:
        children.setdefault(parent, []).append(child)
    rss = {child: kib for child, _, kib in rows}
    todo, total = [pid], 0
    while todo:
        current = todo.pop()
        total += rss.get(current, 0)
        todo += children.get(current, [])
    return total / 1024


def _actor_rss_mib(session: int, name: str) -> list[float]:
    """Resident memory of each Ray actor process whose name holds `name` (ps shows
    ray::[prefix:]Class[.method]) in the session of the Ray head the benchmark started, MiB."""
    out = subprocess.run(["ps", "-e", "-o", "sid=,rss=,args="], capture_output=True, text=True, check=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines() if len(line.split(None, 2)) == 3]
    return [int(rss) / 1024 for sid, rss, args in rows if int(sid) == session and args.startswith("ray::") and name in args.split()[0]]


def run_serve(convs: list[list[dict]], max_tokens: int, threads: int | None, quantization: str, log_dir: Path,
              replicas: int = 1) -> dict:
    """`replicas` fixed replicas of configs/smollm2.yaml; `threads` torch threads each (None:
    the config's)."""
    import yaml

    from benchmarks.serving import LaunchedServer

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml").read_text())
    args = config["applications"][0]["args"]
    args.pop("autoscaling_config", None)
    args |= {"num_replicas": replicas, "max_model_len": ENGINE_OPTIONS["max_model_len"], "quantization": quantization}
    if threads is not None:
        args["num_cpu_threads"] = threads
    with LaunchedServer(config, log_dir) as server:
        start = time.perf_counter()
        server.start(timeout_s=1200, log=lambda message: None)
        result = {"startup_s": time.perf_counter() - start, **_chat_runs(server.base_url, "smollm2", convs, max_tokens)}
        result["scheduler_actor_rss_mib"] = _actor_rss_mib(server.ray_pgid, "SchedulerActor")  # the model processes
    return result


def run_llama_server(binary: str, convs: list[list[dict]], max_tokens: int, threads: int, log_dir: Path) -> dict:
    import httpx

    from benchmarks.serving import free_port
    from rayserve_paged.models.tiny import resolve_model

    port = free_port()
    slots = len(convs)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "llama-server.log", "w") as log:
        proc = subprocess.Popen(
            [binary, "-m", str(resolve_model("smollm2")), "--host", "127.0.0.1", "--port", str(port),
             "-t", str(threads), "-np", str(slots), "-c", str(slots * ENGINE_OPTIONS["max_model_len"])],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            start, base_url = time.perf_counter(), f"http://127.0.0.1:{port}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {proc.returncode}; see {log_dir / 'llama-server.log'}")
                try:
                    if httpx.get(f"{base_url}/health", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            result = {"startup_s": time.perf_counter() - start, **_chat_runs(base_url, "smollm2", convs, max_tokens)}
            result["rss_mib"] = _tree_rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return result


# --------------------------------------------------------------------------- report


def run(args, log) -> dict:
    result = {"threads": args.threads, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
              "cpu": f"{os.cpu_count()} CPUs, torch {torch.__version__}", "loadavg_start": os.getloadavg()}  # fmt: skip
    if not args.no_kernels:
        log("kernels")
        result["kernels_ms_per_30_layers"] = measure_kernels(args.threads)
    for quantization in QUANTIZATIONS:
        log(f"load: quantization {quantization}")
        result[f"load_{quantization}"] = _engine_in_subprocess(quantization, args.threads, 1, 1, load_only=True)
    runs = []
    versions = [args.before, None] if args.before else [None]
    for round_ in range(args.rounds):  # interleaved: the machine's load moves between runs
        for source in versions:
            for quantization in QUANTIZATIONS:
                log(f"engine: quantization {quantization}, round {round_}{', before' if source else ''}")
                runs.append(_engine_in_subprocess(quantization, args.threads, args.num_requests, args.max_tokens,
                                                  source=source))  # fmt: skip
    result["engine"] = runs
    tokens = {run["quantization"]: run.pop("token_ids") for run in runs if "version" not in run}
    for run in runs:
        run.pop("token_ids", None)
    result["agreement"] = agreement(tokens["auto"], tokens["none"])
    convs = conversations(args.num_requests)
    out = Path(args.out)
    if not args.no_http:
        for quantization in QUANTIZATIONS:
            log(f"http: serve run configs/smollm2.yaml, quantization {quantization}")
            result[f"serve_{quantization}"] = run_serve(convs, args.max_tokens, args.threads, quantization,
                                                        out / f"serve-logs-{quantization}")  # fmt: skip
    for layout in args.layouts:  # replicas x threads, quantization auto
        replicas, threads = layout
        log(f"http: serve run configs/smollm2.yaml, {replicas} replica(s) x {threads} thread(s)")
        result[f"serve_layout_{replicas}x{threads}"] = run_serve(convs, args.max_tokens, threads, "auto",
                                                                 out / f"serve-logs-{replicas}x{threads}", replicas)
    if args.llama_server:
        if Path(args.llama_server).is_file():
            log("http: llama-server")
            try:
                result["llama_server"] = run_llama_server(args.llama_server, convs, args.max_tokens, args.threads,
                                                          out / "llama-server-logs")  # fmt: skip
            except (RuntimeError, OSError) as exc:  # the sitting's other figures stay
                result["llama_server"] = {"failed": str(exc)}
        else:
            result["llama_server"] = {"skipped": f"{args.llama_server} does not exist"}
    result["loadavg_end"] = os.getloadavg()
    return result


def _per_cpu(phase: dict) -> str:
    return f" ({phase['tokens_per_cpu_s']:.1f} per CPU-s)" if "tokens_per_cpu_s" in phase else ""


def format_report(r: dict) -> str:
    lines = [f"SmolLM2-135M-Instruct Q4_1 GGUF, {r['threads']} torch thread(s), {r['cpu']}",
             f"load average start {r['loadavg_start']}, end {r['loadavg_end']}"]  # fmt: skip
    if "kernels_ms_per_30_layers" in r:
        lines.append("kernels, ms per 30 layers (qkv, o, gate|up, down):")
        for rows, t in r["kernels_ms_per_30_layers"].items():
            lines.append(f"  {rows:>10} rows  " + "  ".join(f"{k} {v:6.1f}" for k, v in t.items()))
    for q in QUANTIZATIONS:
        load = r[f"load_{q}"]
        lines.append(f"load_model, quantization {q:4s}: {load['load_model_s']:.1f} s, peak RSS {load['peak_rss_gib']:.2f} GiB")
    lines.append(f"engine, in run order (concurrent: {r['num_requests']} chats x {r['max_tokens']} tokens at once):")
    for e in r["engine"]:
        lines.append(
            f"  {e.get('version', 'now'):6s} quantization {e['quantization']:4s}: LLM() {e['llm_construct_s']:.1f} s, single "
            f"{e['single']['tokens_per_s']:.1f} tok/s{_per_cpu(e['single'])}, concurrent "
            f"{e['concurrent']['tokens_per_s']:.1f} tok/s{_per_cpu(e['concurrent'])}, peak RSS {e['peak_rss_gib']:.2f} GiB"
        )
    a = r["agreement"]
    lines.append(
        f"greedy agreement: {a['num_identical']}/{a['num_sequences']} sequences identical, "
        f"{a['tokens_before_first_difference_share']:.1%} of tokens before the first difference"
    )
    for name in ("serve_none", "serve_auto", *[k for k in r if k.startswith("serve_layout_")], "llama_server"):
        if name in r:
            h = r[name]
            if "skipped" in h or "failed" in h:
                lines.append(f"{name}: {'skipped' if 'skipped' in h else 'failed'} ({h.get('skipped') or h['failed']})")
                continue
            rss = f", RSS {h['rss_mib']:.0f} MiB" if "rss_mib" in h else ""
            if h.get("scheduler_actor_rss_mib"):
                rss += ", SchedulerActor RSS " + " + ".join(f"{v:.0f}" for v in h["scheduler_actor_rss_mib"]) + " MiB"
            lines.append(f"{name}: single {h['single']['tokens_per_s']:.1f} tok/s, concurrent "
                         f"{h['concurrent']['tokens_per_s']:.1f} tok/s, startup {h['startup_s']:.1f} s{rss}")  # fmt: skip
    return "\n".join(lines)


def _layouts(text: str) -> list[tuple[int, int]]:
    try:
        layouts = [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"layouts are REPLICASxTHREADS, comma-separated; got {text!r}") from None
    if not all(len(layout) == 2 and min(layout) >= 1 for layout in layouts):
        raise argparse.ArgumentTypeError(f"layouts are REPLICASxTHREADS with both >= 1; got {text!r}")
    return layouts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayserve-paged bench quantized", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for quantized.json")
    add_engine_run_arguments(parser, threads=DEFAULT_THREADS, num_requests=NUM_REQUESTS, max_tokens=MAX_TOKENS,
                             rounds_help="interleaved (none, auto) engine runs")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel timings")
    parser.add_argument("--no-http", action="store_true", help="skip `serve run`")
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server binary (skipped when absent)")
    parser.add_argument("--before", help="source tree of an earlier version whose engine runs too (figures before)")
    parser.add_argument("--layouts", type=_layouts, default=[],
                        help="serve run layouts to compare, REPLICASxTHREADS comma-separated (e.g. 1x2,2x1)")
    parser.add_argument("--engine-child", choices=QUANTIZATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.num_requests, args.max_tokens, args.threads, args.rounds) < 1:
        parser.error("--num-requests, --max-tokens, --threads and --rounds must be >= 1")
    if args.engine_child:
        print(json.dumps(measure_engine(args.engine_child, args.threads, args.num_requests, args.max_tokens,
                                        args.load_only)))  # fmt: skip
        return 0
    if not args.out:
        parser.error("--out is required")
    result = run(args, log=lambda m: print(m, file=sys.stderr, flush=True))
    path = write_record(args.out, "quantized", result)
    print(format_report(result))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
