"""Triton kernels on a GPU: tests, memcheck, decode and prefill timing, the engine end to end.

    python benchmarks/gpu_check.py OUT_DIR [--quick] [--skip-tests] [--skip-e2e] [--cpu-backend B] [--wheels DIR]

With CUDA (sized for one H200, under 8 minutes; --quick does less of each):
  tests    pytest tests/ops/test_triton.py compiled on the GPU (RAYSERVE_PAGED_TRITON_TEST_DEVICE=cuda)
  memcheck the `quick` Triton tests (small shapes) once more under `compute-sanitizer --tool memcheck`
           (skipped, and said so, where compute-sanitizer or CUDA is absent)
  copy     device-to-device copy bandwidth of a 2 GiB tensor (bytes read + written per second):
           the roofline the attention figures are compared with
  decode   paged decode attention for batch 1/16/64/256 x context 512/2048/8192, float16 and
           bfloat16, 32 query / 8 kv heads, head 128, block 16, blocks scattered at random:
           both variants and the rule's pick; bytes it must read, GB/s, share of the copy
           bandwidth; torch SDPA on the same K/V laid out contiguously (time ratio paged / dense)
  prefill  paged prefill attention with and without cached context: time, TFLOP/s, vs SDPA
  quant    quantized linear layers (models/quant.py) on a 4096x4096 weight for 1/16/256 rows:
           FP8 weights (torch._scaled_mm where the GPU is sm_89+, else dequantized at load)
           and 4-bit group-quantized weights (the Triton GEMM, g=128): the error against the
           float32 product of the same weights and the time against bfloat16 F.linear
  runner   the same model through load_model + ModelRunner (no engine: no pydantic, no ray):
           greedy tokens equal to HF in float32; a swap out / swap in round trip halfway
           (tokens unchanged) in fp32 / fp16 / bf16; the static-shape decode path (padded
           buckets, one CUDA graph per bucket and length class) against the eager path's
           tokens; KV sizing from gpu_memory_utilization; no kernel compile after warm-up
           (graph captures included); fp16 / bf16 decode tokens/s with CUDA graphs off and
           on, and the memory the graphs hold against the KV sizing's reserve for them
  e2e      the engine path users run (LLM -> LLMEngine -> InProcessExecutor -> Worker, the
           worker's own device selection, KV sizing and graph capture) on a random-weight
           OPT-1.3B-shaped checkpoint (hidden 2048, 24 layers, ffn 8192, 32 heads; the tiny
           512-token vocabulary) in float16: greedy tokens with attention_backend="triton"
           against HF generate in float16 (match rate), and engine tokens/s with the triton
           backend (CUDA graphs on, KV cache sized by profiling gpu_memory_utilization; and
           enforce_eager) and the torch backend
Without CUDA it runs what a CPU can: the interpreter tests (TRITON_INTERPRET=1; the `quick`
subset with --quick), the runner check on the tiny OPT (HF parity, swap round trip, the
static-shape decode path run eagerly) and the engine end to end on the tiny OPT (torch
backend with and without the static decode path, and the interpreted triton backend,
against HF), the FP8 layer through torch's CPU _scaled_mm (errors only, no timings), and lists
the GPU parts as skipped.

The engine step needs pydantic and the OpenTelemetry SDK, which a bare GPU image may lack:
where they do not import, the wheels in DIR (default: .whl/ in the repository; the pinned
list is benchmarks/gpu_check_wheels.txt) are installed into a temporary folder first, e.g.
after, on any machine with pip and the index,

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_17_x86_64 -d .whl -r benchmarks/gpu_check_wheels.txt

Writes OUT_DIR/gpu_check.json (every figure) and prints a short table last.
Timing: CUDA graph replay (eager when capture fails) between torch.cuda.Event pairs, after
warm-up; the median of the repeats.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Wall-clock guards that keep a full run under 8 minutes: the test runs are killed after
# TESTS_TIMEOUT_S / MEMCHECK_TIMEOUT_S, and no new copy / decode / prefill point starts
# after BENCH_BUDGET_S.
TESTS_TIMEOUT_S = {"quick": 150, "full": 200}
MEMCHECK_TIMEOUT_S = {"quick": 60, "full": 60}
BENCH_BUDGET_S = {"quick": 80.0, "full": 115.0}
# The plan, step by step (seconds on one H200; full run). Each step's time is recorded next
# to its budget; the total leaves a 15-minute GPU slot room for a rerun.
STEP_BUDGET_S = {
    "tests": 200, "memcheck": 60, "copy_bandwidth": 10, "decode": 75, "prefill": 30, "quant": 20, "runner": 75,
    "e2e": 30,
}  # 500 s: 8.3 minutes
# What the engine step imports beyond torch, triton, transformers and safetensors, with the
# distributions benchmarks/gpu_check_wheels.txt pins for them.
ENGINE_MODULES = ("pydantic", "opentelemetry.sdk", "opentelemetry.exporter.prometheus")
DEFAULT_WHEELS = REPO_ROOT / ".whl"
CUDA = "cuda:0"  # every device this script hands the project's code names its index
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (512, 2048, 8192)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
PREFILL_CASES = ((1, 0, 2048), (8, 0, 512), (4, 1024, 512), (16, 0, 128))  # (num_seqs, context, new tokens)
OPT_1_3B = dict(
    hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32, word_embed_proj_dim=2048,
    max_position_embeddings=2048,
)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Paged attention keeps the cache in blocks",
    "Hello",
    "A much longer prompt that runs across more than one block of sixteen tokens, "
    "so that the block tables of this batch have different lengths and shapes",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory for gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="fewer tests, shapes, repeats and layers")
    parser.add_argument("--skip-tests", action="store_true", help="do not run tests/ops/test_triton.py")
    parser.add_argument("--skip-e2e", action="store_true", help="do not run the end-to-end comparison")
    parser.add_argument(
        "--cpu-backend", choices=("triton", "torch"), default="triton",
        help="without CUDA: the runner check's attention backend (triton = the interpreted kernels)",
    )
    parser.add_argument(
        "--wheels", type=Path, default=DEFAULT_WHEELS,
        help="wheels installed (into a temporary folder) when the engine step's packages do not import",
    )
    return parser.parse_args(argv)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() > self.end


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    wheels = bring_wheels(args.wheels)  # before torch: a newer typing_extensions must load first
    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU e2e runs the kernels too
    mode = "quick" if args.quick else "full"
    report: dict = {
        "environment": environment(torch), "quick": args.quick, "skipped": {}, "errors": {}, "wheels": wheels,
    }
    if args.skip_tests:
        report["skipped"]["tests"] = report["skipped"]["memcheck"] = "--skip-tests"
    else:
        run_section(report, "tests", lambda: run_tests(has_cuda, args.quick))
        sanitizer = find_compute_sanitizer()
        why_not = memcheck_skip_reason(has_cuda, sanitizer)
        if why_not:
            report["skipped"]["memcheck"] = why_not
        else:
            run_section(report, "memcheck", lambda: run_memcheck(sanitizer, args.quick))
    if has_cuda:
        deadline = Deadline(BENCH_BUDGET_S[mode])
        run_section(report, "copy_bandwidth", lambda: copy_bandwidth(torch))
        copy_gbps = report.get("copy_bandwidth", {}).get("gbps")
        run_section(report, "decode", lambda: decode_benchmark(torch, args.quick, copy_gbps, deadline))
        run_section(report, "prefill", lambda: prefill_benchmark(torch, args.quick, deadline))
    else:
        for name in ("copy_bandwidth", "decode", "prefill", "e2e_opt_1.3b_shaped"):
            report["skipped"][name] = "no CUDA device: GPU parts skipped"
    run_section(report, "quant", lambda: quant_check(torch, has_cuda))
    if args.skip_e2e:
        report["skipped"]["e2e"] = report["skipped"]["runner"] = "--skip-e2e"
    else:
        run_section(report, "runner", lambda: runner_check(torch, has_cuda, args.quick, args.cpu_backend))
        if wheels["missing"]:
            report["skipped"]["e2e"] = (
                f"the engine (LLM) needs {', '.join(wheels['missing'])}, which do not import, and {args.wheels} "
                "holds no wheels that provide them (benchmarks/gpu_check_wheels.txt lists them)"
            )
        elif has_cuda:
            run_section(report, "e2e", lambda: e2e_gpu(torch, args.quick))
        else:
            run_section(report, "e2e", lambda: e2e_cpu(torch))
    path = args.out_dir / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(format_table(report))
    print(f"full figures: {path}")
    tests_failed = any(report.get(name, {}).get("returncode", 0) != 0 for name in ("tests", "memcheck"))
    failed = any(report.get(name, {}).get("failures") for name in ("runner", "e2e", "quant"))
    return 1 if tests_failed or failed or report["errors"] else 0


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or the module is blocked
        return False


def bring_wheels(wheel_dir: Path | None, modules: tuple[str, ...] = ENGINE_MODULES) -> dict:
    """Make `modules` importable: where one is not, install every wheel in `wheel_dir` with
    pip (no index, no dependencies resolved: the folder holds them) into a temporary folder
    put first on sys.path and on PYTHONPATH (for the test subprocesses). Returns what was
    missing before, what was installed and what is still missing."""
    missing = [module for module in modules if not _importable(module)]
    result: dict = {"missing_before": missing, "installed": [], "missing": missing}
    wheels = sorted(wheel_dir.glob("*.whl")) if missing and wheel_dir is not None and wheel_dir.is_dir() else []
    if not wheels:
        return result
    target = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--disable-pip-version-check",
         "--target", str(target), *map(str, wheels)],
        check=True, timeout=300,
    )
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(target), os.environ.get("PYTHONPATH"))))
    importlib.invalidate_caches()
    result |= {
        "installed": [wheel.name for wheel in wheels], "target": str(target),
        "missing": [module for module in modules if not _importable(module)],
    }
    return result


def run_section(report: dict, name: str, fn) -> None:
    budget = STEP_BUDGET_S.get(name)
    print(f"[gpu_check] {name} (budget {budget} s) ...", flush=True)
    started = time.monotonic()
    try:
        report[name] = fn()
    except Exception as error:  # one broken section must not hide the others' figures
        report["errors"][name] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    seconds = round(time.monotonic() - started, 1)
    report.setdefault("step_seconds", {})[name] = {"seconds": seconds, "budget": budget}
    print(f"[gpu_check] {name} done in {seconds}s (budget {budget} s)", flush=True)


def environment(torch) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as error:
        info["triton"] = f"not importable: {error}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"device": props.name, "num_sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30}
    return info


# ---------------------------------------------------------------------------- tests


TRITON_TESTS = [sys.executable, "-m", "pytest", "tests/ops/test_triton.py", "-q", "-p", "no:cacheprovider"]


def run_tests(has_cuda: bool, quick: bool) -> dict:
    device = "cuda" if has_cuda else "cpu"
    command = TRITON_TESTS + (["-m", "quick"] if quick else [])
    result = _run_pytest(command, device, TESTS_TIMEOUT_S["quick" if quick else "full"])
    del result["output"]
    return result | {"device": device, "interpreter": not has_cuda}


def find_compute_sanitizer() -> str | None:
    """compute-sanitizer on PATH, in $CUDA_HOME/bin or in a /usr/local/cuda*/bin; None if absent."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    folders = [Path(os.environ["CUDA_HOME"]) / "bin"] if os.environ.get("CUDA_HOME") else []
    folders += sorted(Path("/usr/local").glob("cuda*/bin"))
    return next((str(folder / "compute-sanitizer") for folder in folders if (folder / "compute-sanitizer").is_file()), None)


def memcheck_skip_reason(has_cuda: bool, sanitizer: str | None) -> str | None:
    """Why the memcheck step cannot run here; None when it can."""
    if not has_cuda:
        return "no CUDA device: compute-sanitizer has nothing to check"
    if sanitizer is None:
        return "compute-sanitizer not found (looked on PATH, in $CUDA_HOME/bin and /usr/local/cuda*/bin)"
    return None


def run_memcheck(sanitizer: str, quick: bool) -> dict:
    """The `quick` Triton tests (one per kernel path, small shapes; the kernels compiled by
    the tests step come from Triton's cache) under compute-sanitizer's memcheck: any
    out-of-bounds or misaligned access fails the step."""
    command = [sanitizer, "--tool", "memcheck", "--error-exitcode", "1", "--print-limit", "20",
               "--target-processes", "all"] + TRITON_TESTS + ["-m", "quick"]
    result = _run_pytest(command, "cuda", MEMCHECK_TIMEOUT_S["quick" if quick else "full"])
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", result.pop("output"))
    return result | {"sanitizer_errors": int(errors[-1]) if errors else None, "clean": result["returncode"] == 0}


def _run_pytest(command: list[str], device: str, timeout: float) -> dict:
    env = os.environ | {"RAYSERVE_PAGED_TRITON_TEST_DEVICE": device}
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in result.stdout.strip().splitlines()  # pytest's last line: "N passed ... in S s"
             if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s", line)]
    summary = lines[-1] if lines else (result.stdout.strip().splitlines() or [""])[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-2000:], sep="\n")
    return {
        "command": " ".join(command[1:] if command[0] == sys.executable else command), "returncode": result.returncode,
        "summary": summary, "counts": counts, "seconds": round(time.monotonic() - started, 1),
        "output": result.stdout + result.stderr,
    }


# ---------------------------------------------------------------------------- timing


def cuda_median_ms(torch, fn, *, repeats: int, warmup: int = 3) -> dict:
    """Median ms of `fn` replayed from a CUDA graph (eager if capture fails), and eager."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    eager_ms = _median_ms(torch, fn, repeats)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        return {"ms": _median_ms(torch, graph.replay, repeats), "eager_ms": eager_ms, "timing": "cuda_graph"}
    except Exception as error:  # noqa: BLE001 - fall back to eager timing, and say so
        torch.cuda.synchronize()
        return {"ms": eager_ms, "eager_ms": eager_ms, "timing": f"eager ({type(error).__name__})"}


def _median_ms(torch, fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(torch, num_bytes: int = 2 * 2**30) -> dict:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    timed = cuda_median_ms(torch, lambda: dst.copy_(src), repeats=20)
    gbps = 2 * num_bytes / (timed["ms"] * 1e-3) / 1e9  # read + write
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": num_bytes, "ms": timed["ms"], "gbps": gbps, "note": "GB/s counts bytes read + written"}


# ---------------------------------------------------------------------------- decode


def decode_bytes(batch: int, context: int, element_size: int, *, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                 head_dim=HEAD_DIM, block_size=BLOCK_SIZE) -> int:
    """Bytes a decode step must move: each sequence's K and V, its query and output, its
    block table row and length."""
    kv = 2 * context * num_kv_heads * head_dim * element_size
    query_and_out = 2 * num_heads * head_dim * element_size
    table = math.ceil(context / block_size) * 4 + 4
    return batch * (kv + query_and_out + table)


def decode_benchmark(torch, quick: bool, copy_gbps: float | None, deadline: Deadline) -> list[dict]:
    dtypes = (torch.float16,) if quick else (torch.float16, torch.bfloat16)
    batches = (1, 64) if quick else DECODE_BATCHES
    contexts = (512, 8192) if quick else DECODE_CONTEXTS
    rows = []
    for dtype in dtypes:
        for batch in batches:
            for context in contexts:
                if deadline.expired():
                    rows.append({"dtype": str(dtype), "batch": batch, "context": context, "skipped": "time budget"})
                    continue
                row = decode_point(torch, dtype, batch, context, repeats=10 if quick else 20)
                if copy_gbps:
                    row["fraction_of_copy_bandwidth"] = row["gbps"] / copy_gbps
                rows.append(row)
                print(f"  decode {row['dtype']} batch {batch} context {context}: {row['ms']:.4f} ms "
                      f"{row['gbps']:.0f} GB/s ({row['variant']}), dense {row.get('dense_ms', float('nan')):.4f} ms",
                      flush=True)
    return rows


def decode_point(torch, dtype, batch: int, context: int, *, repeats: int, device=CUDA, timer=None) -> dict:
    """One decode measurement. `device` and `timer` exist so the CPU tests can run this
    code under the interpreter with a stand-in timer."""
    import torch.nn.functional as F

    from rayserve_paged.ops.triton_backend import NOMINAL_NUM_SMS, choose_decode_variant, paged_decode_attention

    timer = timer or cuda_median_ms
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    generator = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
    # blocks scattered over the pool, as after a while of serving
    block_tables = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)  # [batch, blocks_per_seq]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn((batch, NUM_HEADS, HEAD_DIM), generator=generator, device=device, dtype=dtype)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    is_cuda = torch.device(device).type == "cuda"
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if is_cuda else NOMINAL_NUM_SMS
    rule = choose_decode_variant(batch, NUM_KV_HEADS, context, num_sms)

    def paged(variant):
        return lambda: paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, context, scale, out=out, variant=variant
        )

    timings = {variant: timer(torch, paged(variant), repeats=repeats) for variant in ("single", "partitioned")}
    num_bytes = decode_bytes(batch, context, query.element_size())
    row = {
        "dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context, "variant": rule,
        "ms": timings[rule]["ms"], "eager_ms": timings[rule]["eager_ms"], "timing": timings[rule]["timing"],
        "single_ms": timings["single"]["ms"], "partitioned_ms": timings["partitioned"]["ms"],
        "bytes": num_bytes, "gbps": num_bytes / (timings[rule]["ms"] * 1e-3) / 1e9,
    }
    row["rule_picked_faster"] = timings[rule]["ms"] <= min(t["ms"] for t in timings.values()) * 1.02
    # the same K/V laid out contiguously: [batch, num_kv_heads, context, head_dim]
    index = block_tables.long()
    dense_k = key_cache[index].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    dense_v = value_cache[index].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    grouped_query = query.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)  # heads folded as rows

    def dense():
        return F.scaled_dot_product_attention(grouped_query, dense_k, dense_v, scale=scale)

    dense_timing = timer(torch, dense, repeats=repeats)
    row |= {"dense_ms": dense_timing["ms"], "paged_over_dense": row["ms"] / dense_timing["ms"]}
    paged(rule)()
    row["max_abs_diff_vs_dense"] = float((out.view_as(grouped_query).float() - dense().float()).abs().max())
    del key_cache, value_cache, dense_k, dense_v, block_tables, query, out
    _free_memory(torch)
    return row


# ---------------------------------------------------------------------------- prefill


def prefill_benchmark(torch, quick: bool, deadline: Deadline) -> list[dict]:
    dtypes = (torch.float16,) if quick else (torch.float16, torch.bfloat16)
    cases = PREFILL_CASES[:2] if quick else PREFILL_CASES
    rows = []
    for dtype in dtypes:
        for num_seqs, context, new_tokens in cases:
            if deadline.expired():
                rows.append({"dtype": str(dtype), "num_seqs": num_seqs, "skipped": "time budget"})
                continue
            row = prefill_point(torch, dtype, num_seqs, context, new_tokens, repeats=10 if quick else 20)
            rows.append(row)
            print(f"  prefill {row['dtype']} {num_seqs} x ({context} + {new_tokens}): {row['ms']:.3f} ms "
                  f"{row['tflops']:.1f} TFLOP/s", flush=True)
    return rows


def prefill_flops(num_seqs: int, context: int, new_tokens: int, num_heads=NUM_HEADS, head_dim=HEAD_DIM) -> int:
    """2 matmuls x 2 flops per multiply-add over the visible (query, key) pairs."""
    visible = new_tokens * context + new_tokens * (new_tokens + 1) // 2
    return 4 * num_seqs * num_heads * head_dim * visible


def prefill_point(
    torch, dtype, num_seqs: int, context: int, new_tokens: int, *, repeats: int, device=CUDA, timer=None
) -> dict:
    import torch.nn.functional as F

    from rayserve_paged.ops.triton_backend import paged_prefill_attention

    timer = timer or cuda_median_ms
    seq_len = context + new_tokens
    blocks_per_seq = math.ceil(seq_len / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    generator = torch.Generator(device=device).manual_seed(num_seqs * 7919 + seq_len)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32)
    block_tables = block_tables.view(num_seqs, blocks_per_seq)  # [num_seqs, blocks_per_seq]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * new_tokens
    context_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    query = torch.randn((num_seqs * new_tokens, NUM_HEADS, HEAD_DIM), generator=generator, device=device, dtype=dtype)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5

    def paged():
        return paged_prefill_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, context_lens, new_tokens, scale, out=out
        )

    timing = timer(torch, paged, repeats=repeats)
    flops = prefill_flops(num_seqs, context, new_tokens)
    row = {
        "dtype": str(dtype).removeprefix("torch."), "num_seqs": num_seqs, "context": context, "new_tokens": new_tokens,
        "ms": timing["ms"], "eager_ms": timing["eager_ms"], "timing": timing["timing"],
        "tflops": flops / (timing["ms"] * 1e-3) / 1e12,
    }
    # dense: SDPA over contiguous [num_seqs, heads, len, head_dim], K/V repeated to every query head
    group = NUM_HEADS // NUM_KV_HEADS
    index = block_tables.long()
    dense_k = key_cache[index].reshape(num_seqs, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2)
    dense_v = value_cache[index].reshape(num_seqs, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2)
    dense_k = dense_k.repeat_interleave(group, dim=1).contiguous()  # [num_seqs, heads, seq_len, head_dim]
    dense_v = dense_v.repeat_interleave(group, dim=1).contiguous()
    dense_q = query.view(num_seqs, new_tokens, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    try:
        if context == 0:
            def dense():
                return F.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=True, scale=scale)
        else:
            from torch.nn.attention.bias import causal_lower_right

            bias = causal_lower_right(new_tokens, seq_len)

            def dense():
                return F.scaled_dot_product_attention(dense_q, dense_k, dense_v, attn_mask=bias, scale=scale)

        dense_timing = timer(torch, dense, repeats=repeats)
        row |= {"dense_ms": dense_timing["ms"], "paged_over_dense": timing["ms"] / dense_timing["ms"]}
        paged()
        expected = dense().transpose(1, 2).reshape_as(out)
        row["max_abs_diff_vs_dense"] = float((out.float() - expected.float()).abs().max())
    except Exception as error:  # noqa: BLE001 - the paged figures stand without the comparison
        row["dense_error"] = f"{type(error).__name__}: {error}"
    del key_cache, value_cache, dense_k, dense_v
    _free_memory(torch)
    return row


def quant_check(torch, has_cuda: bool) -> dict:
    """FP8 and 4-bit group-quantized layers against the float32 product of their own weights;
    on CUDA also their time against bfloat16 F.linear (see the module docstring)."""
    from rayserve_paged.models.layers import ColumnParallelLinear
    from rayserve_paged.models.quant import Fp8LinearMethod, GroupQuantFormat, GroupQuantLinearMethod, quantize_fp8

    device = torch.device(CUDA if has_cuda else "cpu")
    size = 4096 if has_cuda else 256
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(size, size, generator=g) * 0.02
    layers = {}
    fp8 = ColumnParallelLinear(size, size, bias=False)
    fp8.set_method(Fp8LinearMethod(None if has_cuda else True))  # the CPU: torch's _scaled_mm, forced
    w8, scale = quantize_fp8(weight)
    fp8.weight.data.copy_(w8), fp8.weight_scale.data.copy_(scale)
    layers["fp8"] = fp8
    if has_cuda:
        int4 = ColumnParallelLinear(size, size, bias=False)
        int4.set_method(GroupQuantLinearMethod(GroupQuantFormat("int4", 4, 128)))
        int4.weight_codes.data.copy_(torch.randint(0, 16, (size, size), generator=g, dtype=torch.uint8))
        int4.weight_scales.data.copy_(torch.rand(size, size // 128, generator=g) * 0.01)
        int4.weight_offsets.data.copy_(-8 * int4.weight_scales.data)
        layers["int4"] = int4
    rows = []
    for name, layer in layers.items():
        layer.to(device)
        layer.model_dtype = torch.bfloat16 if has_cuda else torch.float32
        layer.process_weights_after_loading()
        reference = layer.method.dequantize(layer)  # [out, in] float32: the layer's own weights
        dense = reference.to(torch.bfloat16)
        kernel = ("torch._scaled_mm" if layer.fp8_scaled_mm else "dequantized at load") if name == "fp8" else "triton"
        for num_rows in (1, 16, 256):
            x = torch.randn(num_rows, size, generator=g).to(device, layer.model_dtype)
            y = layer.matmul(x).float()
            want = x.float() @ reference.t()
            bound = 2**-3 * (x.float().abs() @ reference.abs().t()) + 1e-3  # activations rounded to 8 bits or fewer
            row = {"rows": num_rows, "layer": name, "kernel": kernel,
                   "error_over_bound": ((y - want).abs() / bound).max().item()}  # fmt: skip
            if has_cuda:
                row["ms"] = cuda_median_ms(torch, lambda: layer.matmul(x), repeats=20)["ms"]
                xb = x.to(torch.bfloat16)
                row["bf16_ms"] = cuda_median_ms(torch, lambda: torch.nn.functional.linear(xb, dense), repeats=20)["ms"]
            rows.append(row)
    bad = [row for row in rows if row["error_over_bound"] > 1]
    return {"device": str(device), "rows": rows, "failures": [f"{r['layer']} x{r['rows']}: error above the bound"
                                                               for r in bad]}  # fmt: skip


def _free_memory(torch) -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- model runner end to end
#
# Only torch, triton, transformers and safetensors: the model, the ModelRunner, the kernels,
# the swapper and the KV sizing, driven by a minimal greedy loop (no scheduler, no engine
# configuration, so neither pydantic nor ray is imported).


def runner_check(torch, has_cuda: bool, quick: bool, cpu_backend: str = "triton") -> dict:
    """Greedy tokens of the model runner against HF generate in float32 (triton backend on
    the GPU; torch and the interpreted kernels on CPU), the same run with every block swapped
    out to pinned host memory and back into other blocks halfway, the KV cache sized from
    gpu_memory_utilization, no kernel compile after warm-up, and fp16 / bf16 decode
    throughput of the runner."""
    from transformers import AutoModelForCausalLM

    from rayserve_paged.models.loader import get_model_config, load_model
    from rayserve_paged.models.sampler import Sampler
    from rayserve_paged.models.tiny import make_tiny_model
    from rayserve_paged.ops import triton_backend
    from rayserve_paged.ops.backends import get_attention_backend
    from rayserve_paged.ops.cache_ops import BlockSwapper
    from rayserve_paged.worker.model_runner import ModelRunner
    from rayserve_paged.worker.static_decode import StaticDecode

    device = CUDA if has_cuda else "cpu"
    backend_name = "triton" if has_cuda or (cpu_backend == "triton" and triton_backend.is_interpreted()) else "torch"
    shape = (OPT_1_3B | ({"num_hidden_layers": 4} if quick else {})) if has_cuda else {}
    block_size, max_new = 16, (16 if quick or not has_cuda else 32)
    result: dict = {"device": device, "backend": backend_name, "failures": []}
    with tempfile.TemporaryDirectory(prefix="gpu-check-runner-") as path:
        make_tiny_model("opt", path, **shape)
        mc = get_model_config(path)
        backend = get_attention_backend(backend_name, device)
        tokenizer_ids = _prompt_ids(path)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        eos_ids = set(mc.eos_token_ids)
        expected = [hf_greedy(hf_model, torch, ids, max_new, eos_ids) for ids in tokenizer_ids]
        del hf_model
        _free_memory(torch)
        for dtype in ("float32", "float16", "bfloat16") if has_cuda else ("float32",):
            model = load_model(path, dtype, device, backend)
            eos = tuple(mc.eos_token_ids)
            runner = ModelRunner(model, block_size, torch.device(device), Sampler(len(eos), eos))
            blocks_per_seq = -(-(max(map(len, tokenizer_ids)) + max_new) // block_size)
            num_blocks = profile_cache_blocks(2 * len(tokenizer_ids), blocks_per_seq)  # twice: the swap round trip
            if has_cuda and dtype == "float32":
                result["kv_sizing"] = kv_sizing(torch, runner, mc, backend, block_size, dtype)
            caches = _caches(torch, mc, num_blocks, block_size, getattr(torch, dtype), device)
            host = _caches(torch, mc, num_blocks, block_size, getattr(torch, dtype), "cpu", pin=has_cuda)
            compiled_before = None
            qkv_stride = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim  # queries: slices of one QKV projection
            if has_cuda:
                started = time.monotonic()
                result.setdefault("warm_up", {})[dtype] = {
                    "variants": backend.warm_up(*caches[0], mc.num_heads, qkv_stride),
                    "seconds": round(time.monotonic() - started, 2),
                }
                compiled_before = compiled_variants()
            ours = [_cut_at_eos(tokens, eos_ids) for tokens in
                    runner_greedy(runner, caches, tokenizer_ids, max_new, block_size, blocks_per_seq)]
            # the static-shape decode path: 4 prompts in buckets 1, 2, 4 (graphs on CUDA)
            runner.static_decode = StaticDecode(
                model, block_size, len(tokenizer_ids), mc.max_model_len, device, backend
            )
            result.setdefault("static_decode_graphs", {})[dtype] = runner.static_decode.capture(caches)
            static = [_cut_at_eos(tokens, eos_ids) for tokens in
                      runner_greedy(runner, caches, tokenizer_ids, max_new, block_size, blocks_per_seq)]
            result.setdefault("static_decode_runs", {})[dtype] = dict(runner.static_decode.runs)
            runner.static_decode = None
            result.setdefault("static_decode_equal", {})[dtype] = static == ours
            if static != ours and dtype == "float32":
                result["failures"].append("float32: the static-shape decode path's tokens differ from the eager path's")
            swapper = BlockSwapper(caches, host)
            swapped = [_cut_at_eos(tokens, eos_ids) for tokens in
                       runner_greedy(runner, caches, tokenizer_ids, max_new, block_size, blocks_per_seq, swapper)]
            if dtype == "float32":
                exact = sum(a == b for a, b in zip(ours, expected))
                result["hf_parity_float32"] = {"prompts": len(expected), "exact": exact}
                if ours != expected:
                    result["failures"].append("float32 greedy tokens differ from HF")
            result.setdefault("swap_roundtrip_equal", {})[dtype] = swapped == ours
            if swapped != ours:
                result["failures"].append(f"{dtype}: tokens after a swap-out / swap-in differ")
            if has_cuda:
                result.setdefault("decode_tokens_per_s", {})[dtype] = runner_throughput(
                    torch, runner, caches, mc, block_size, quick, backend
                )
                compiled_after = compiled_variants()
                result.setdefault("compiles_after_warm_up", {})[dtype] = (
                    None if compiled_before is None or compiled_after is None else compiled_after - compiled_before
                )
                if compiled_before is not None and compiled_after is not None and compiled_after != compiled_before:
                    extra = compiled_after - compiled_before
                    result["failures"].append(f"{dtype}: {extra} kernel compiles after warm-up")
            del model, runner, caches, host
            _free_memory(torch)
    result["model"] = "random-weight OPT-1.3B-shaped" if has_cuda else "tiny OPT (CPU)"
    return result


def _cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """The tokens up to and including the first EOS, as HF generate returns them."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def _prompt_ids(path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]


def _caches(torch, mc, num_blocks, block_size, dtype, device, pin=False):
    shape = (num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin),
         torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin))
        for _ in range(mc.num_layers)
    ]


def runner_greedy(runner, caches, prompts, max_new, block_size, blocks_per_seq, swapper=None) -> list[list[int]]:
    """Greedy decoding of every prompt in one batch through ModelRunner.execute. Sequence i
    owns blocks [1 + i * blocks_per_seq, ...); with a swapper, halfway through every
    sequence's blocks go out to the host pool and come back into the other half of the pool."""
    from rayserve_paged.core.outputs import NewRequest, StepMessage
    from rayserve_paged.core.sequence import SamplingParams

    num_blocks = caches[0][0].shape[0]
    needed = profile_cache_blocks(len(prompts) * (2 if swapper is not None else 1), blocks_per_seq)
    if needed > num_blocks:  # no kernel checks block ids: an id past the pool reads and writes out of bounds
        raise ValueError(f"runner_greedy: the tables need {needed} cache blocks (block 0 unused), the cache has {num_blocks}")
    longest = max(map(len, prompts)) + max_new - 1  # tokens cached before the last step
    if longest > blocks_per_seq * block_size:
        raise ValueError(f"runner_greedy: {longest} tokens do not fit {blocks_per_seq} blocks of {block_size}")
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    ids = [f"greedy-{i}-{id(outputs)}" for i in range(len(prompts))]
    rows = list(range(len(prompts)))
    for step in range(max_new):
        msg = StepMessage(seq_ids=rows)
        if step == 0:
            msg.new_requests = [NewRequest(ids[i], i, params, len(prompt)) for i, prompt in enumerate(prompts)]
            msg.block_table_updates = [(i, 0, tables[i]) for i in rows]
            msg.start_positions = [0 for _ in rows]
            msg.num_query_tokens = [len(prompt) for prompt in prompts]
            msg.token_ids = [token for prompt in prompts for token in prompt]
            msg.first_step_seq_ids = rows
        else:
            if swapper is not None and step == max_new // 2:
                offset = len(prompts) * blocks_per_seq
                swapper.swap_out([(block, block) for table in tables for block in table])
                swapper.swap_in([(block, block + offset) for table in tables for block in table])
                tables = [[block + offset for block in table] for table in tables]
                msg.block_table_updates = [(i, 0, tables[i]) for i in rows]
            msg.start_positions = [len(prompt) + step - 1 for prompt in prompts]
            msg.num_query_tokens = [1 for _ in rows]
            msg.token_ids = [out[-1] for out in outputs]
        samples = runner.execute(msg, caches).samples
        for i, sample in enumerate(samples):
            outputs[i].append(sample.token_ids[0])
    runner.execute(StepMessage(finished_request_ids=ids), caches)
    if swapper is not None:
        swapper.finish()
    return outputs


def runner_throughput(torch, runner, caches, mc, block_size, quick: bool, backend) -> dict:
    """Tokens per second of the runner for a batch of random prompts (one prefill step, then
    decode steps), with CUDA graphs off (eager on the exact batch) and on (StaticDecode with
    a graph per bucket up to the batch, captured on these caches), the tokens of the two
    runs compared, and the memory the graphs hold against StaticDecode.profile_bytes (what
    the worker's KV sizing reserves for them)."""
    import random

    from rayserve_paged.worker.static_decode import StaticDecode

    rng = random.Random(0)
    batch, prompt_len, steps = (16, 128, 16) if quick else (64, 256, 32)
    prompts = [[rng.randrange(7, 512) for _ in range(prompt_len)] for _ in range(batch)]
    blocks_per_seq = -(-(prompt_len + steps) // block_size)
    if profile_cache_blocks(batch, blocks_per_seq) > caches[0][0].shape[0]:
        bigger = _caches(torch, mc, profile_cache_blocks(batch, blocks_per_seq), block_size, caches[0][0].dtype, CUDA)
    else:
        bigger = caches
    result: dict = {"batch": batch, "prompt_len": prompt_len, "new_tokens": steps}
    tokens = {}
    for mode in ("graphs_off", "graphs_on"):
        runner.static_decode = None
        if mode == "graphs_on":
            static = StaticDecode(runner.model, block_size, batch, mc.max_model_len, CUDA, backend)
            reserved = static.profile_bytes(bigger)
            torch.cuda.synchronize()
            before, started = torch.cuda.memory_allocated(), time.perf_counter()
            result["graph_buckets"] = static.capture(bigger)
            result["capture_seconds"] = round(time.perf_counter() - started, 2)
            held = torch.cuda.memory_allocated() - before
            result["graph_memory_mib"] = {"held": round(held / 2**20, 1), "reserved": round(reserved / 2**20, 1)}
            result["graph_reserve_covers_capture"] = held <= reserved
            runner.static_decode = static
        torch.cuda.synchronize()
        started = time.perf_counter()
        tokens[mode] = runner_greedy(runner, bigger, prompts, steps, block_size, blocks_per_seq)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        result[mode] = {"seconds": round(seconds, 3), "tokens_per_s": round(batch * steps / seconds, 1)}
        if mode == "graphs_on":
            result["graph_replays"] = runner.static_decode.runs["graph"]
    runner.static_decode = None
    result["graphs_on_over_off"] = round(result["graphs_off"]["seconds"] / result["graphs_on"]["seconds"], 3)
    result["tokens_equal_rows"] = sum(a == b for a, b in zip(tokens["graphs_off"], tokens["graphs_on"]))
    return result


def kv_sizing(torch, runner, mc, backend, block_size, dtype) -> dict:
    """Blocks the KV cache gets from gpu_memory_utilization=0.9 after a 2048-token profile step,
    with the decode workspace and the CUDA graphs of max_num_seqs=256 reserved (as the worker
    does)."""
    from rayserve_paged.worker.kv_sizing import kv_cache_budget_bytes
    from rayserve_paged.worker.static_decode import StaticDecode

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free_before, total = torch.cuda.mem_get_info()
    blocks_per_seq = 2048 // block_size
    # block 0 is never handed out (runner_greedy's tables start at block 1), as in the other callers
    caches = _caches(torch, mc, profile_cache_blocks(1, blocks_per_seq), block_size, getattr(torch, dtype), CUDA)
    runner_greedy(runner, caches, [[7] * 2047], 1, block_size, blocks_per_seq)
    torch.cuda.synchronize()
    allocated, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    workspace = backend.decode_workspace_bytes(256, mc.num_heads, mc.num_kv_heads, mc.head_dim, 2048, CUDA)
    graphs = StaticDecode(runner.model, block_size, 256, 2048, CUDA, backend).profile_bytes(caches)
    budget = kv_cache_budget_bytes(total, free_before, allocated, peak, 0.9, workspace, cuda_graph_bytes=graphs)
    element_size = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    block_bytes = 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * element_size
    num_blocks = max(budget // block_bytes, 0)
    del caches
    torch.cuda.empty_cache()
    allocated = _caches(torch, mc, num_blocks, block_size, getattr(torch, dtype), CUDA)  # must fit
    used = torch.cuda.mem_get_info()
    del allocated
    torch.cuda.empty_cache()
    return {"gpu_memory_utilization": 0.9, "budget_gib": budget / 2**30, "num_blocks": num_blocks,
            "decode_workspace_mib": workspace / 2**20, "cuda_graph_reserve_mib": graphs / 2**20,
            "free_after_allocation_gib": used[0] / 2**30}


def profile_cache_blocks(num_seqs: int, blocks_per_seq: int) -> int:
    """Cache blocks for runner_greedy's tables: sequence i owns blocks
    [1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq), so the pool needs one block more
    than the sequences hold (block 0 stays unused)."""
    return 1 + num_seqs * blocks_per_seq


def compiled_variants() -> int | None:
    """How many compiled variants the attention kernels hold (triton's in-memory caches);
    None when this triton keeps them where this cannot count them."""
    from rayserve_paged.ops import triton_kernels

    total = 0
    for name in ("paged_decode_kernel", "paged_decode_partition_kernel", "paged_decode_reduce_kernel",
                 "paged_prefill_kernel", "reshape_and_cache_kernel"):
        kernel = getattr(triton_kernels, name)
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        for entry in caches.values():
            first = entry[0] if isinstance(entry, tuple) else entry
            if not isinstance(first, dict):
                return None
            total += len(first)
    return total


# ---------------------------------------------------------------------------- end to end


def hf_greedy(model, torch, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """HF generate on one unpadded prompt; the new tokens, cut after the first EOS."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids], device=device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        )
    new = out[0, len(prompt_ids) :].tolist()
    for i, token in enumerate(new):
        if token in eos_ids:
            return new[: i + 1]
    return new


def compare_with_hf(llm, hf_model, torch, max_tokens: int) -> dict:
    from rayserve_paged import SamplingParams

    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    eos = hf_model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    exact, common, total = 0, 0, 0
    for output in outputs:
        ours = output.outputs[0].token_ids
        theirs = hf_greedy(hf_model, torch, output.prompt_token_ids, max_tokens, eos_ids)
        exact += ours == theirs
        prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        common += prefix
        total += max(len(ours), len(theirs))
    return {
        "prompts": len(outputs), "exact_match_rate": exact / len(outputs),
        "token_match_rate": common / max(total, 1), "max_tokens": max_tokens,
    }


def throughput(llm, num_prompts: int, prompt_len: int, max_tokens: int, sync) -> dict:
    import random

    from rayserve_paged import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(7, 512) for _ in range(prompt_len)] for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=params, use_tqdm=False)  # warm-up
    sync()
    started = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "num_prompts": num_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens, "seconds": seconds,
        "output_tokens_per_s": generated / seconds,
        "total_tokens_per_s": (generated + num_prompts * prompt_len) / seconds,
    }


def e2e_gpu(torch, quick: bool) -> dict:
    from rayserve_paged.models.tiny import make_tiny_model

    shape = OPT_1_3B | ({"num_hidden_layers": 4} if quick else {})
    name = "random-weight OPT-1.3B-shaped" + (", 4 layers (--quick)" if quick else "")
    num_prompts = 16 if quick else 64
    # max_num_seqs = the load's batch: graphs for buckets 1..num_prompts only, and one length
    # class (max_model_len 1024 holds the load's 256 + 128 tokens)
    common = dict(dtype="float16", device="auto", max_model_len=1024, swap_space_gb=1, max_num_seqs=num_prompts)
    runs = {
        # CUDA graphs on, the KV cache sized the way a user's start-up sizes it: profiled
        "triton": common | dict(attention_backend="triton", gpu_memory_utilization=0.3),
        "triton:eager": common | dict(attention_backend="triton", enforce_eager=True, kv_cache_memory_gb=16),
        "torch": common | dict(attention_backend="torch", kv_cache_memory_gb=16),
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-opt-") as path:
        started = time.monotonic()
        make_tiny_model("opt", path, **shape)
        checkpoint_seconds = time.monotonic() - started
        result = e2e_run(
            torch, path, device="cuda", dtype="float16", runs=runs, parity_tokens=16 if quick else 32,
            load=dict(num_prompts=16, prompt_len=128, max_tokens=64) if quick
            else dict(num_prompts=64, prompt_len=256, max_tokens=128),
        )
    result |= {"model": name, "config": shape, "checkpoint_seconds": checkpoint_seconds}
    result["triton_over_torch_tokens_per_s"] = (
        result["throughput_triton"]["output_tokens_per_s"] / result["throughput_torch"]["output_tokens_per_s"]
    )
    result["cuda_graphs_over_eager_tokens_per_s"] = (
        result["throughput_triton"]["output_tokens_per_s"] / result["throughput_triton:eager"]["output_tokens_per_s"]
    )
    return result


def e2e_cpu(torch) -> dict:
    """The tiny OPT on CPU through the engine: the torch backend with the static decode path
    (padded buckets, eager: no CUDA) and with enforce_eager, and the triton kernels under
    the interpreter; float32 greedy tokens must equal HF's."""
    from rayserve_paged.models.tiny import make_tiny_model
    from rayserve_paged.ops import triton_backend

    common = dict(dtype="float32", device="auto", kv_cache_memory_gb=0.05, max_model_len=256, swap_space_gb=0.01)
    runs = {"torch": common | dict(attention_backend="torch"),
            "torch:eager": common | dict(attention_backend="torch", enforce_eager=True)}
    if triton_backend.is_interpreted():
        runs["triton"] = common | dict(attention_backend="triton")
    with tempfile.TemporaryDirectory(prefix="gpu-check-tiny-") as path:
        make_tiny_model("opt", path)
        result = e2e_run(
            torch, path, device="cpu", dtype="float32", runs=runs, parity_tokens=12,
            load=dict(num_prompts=4, prompt_len=24, max_tokens=8),
        )
    result["model"] = "tiny OPT (hidden 64, 2 layers, 4 heads, head 16), CPU"
    if "triton" not in runs:
        result["triton_skipped"] = "the kernels were imported without TRITON_INTERPRET=1"
    for label in runs:
        if result[f"hf_parity_{label}"]["exact_match_rate"] != 1.0:
            result["failures"].append(f"{label}: float32 greedy tokens differ from HF")
    return result


def e2e_run(torch, path, *, device, dtype, runs: dict[str, dict], parity_tokens, load) -> dict:
    """Greedy parity with HF (same dtype), throughput and the engine path each run took, for
    each run's engine options (`LLM(model=path, **options)`)."""
    from transformers import AutoModelForCausalLM

    from rayserve_paged import LLM

    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    result: dict = {"dtype": dtype, "device": device, "failures": []}
    for label, options in runs.items():
        llm = LLM(model=path, **options)
        result[f"hf_parity_{label}"] = compare_with_hf(llm, hf_model, torch, max_tokens=parity_tokens)
        result[f"throughput_{label}"] = throughput(llm, **load, sync=sync)
        path_taken = result[f"engine_path_{label}"] = engine_path(llm)
        result["failures"] += [f"{label}: {problem}" for problem in engine_path_problems(path_taken, options, device)]
        del llm
        _free_memory(torch)
    del hf_model
    _free_memory(torch)
    return result


def engine_path(llm) -> dict:
    """What the engine built: its executor and worker, the worker's device, its KV pool, the
    decode graphs it captured and the steps each decode path ran."""
    executor = llm.engine.executor
    worker = executor.worker
    static = worker.runner.static_decode
    return {
        "engine": type(llm.engine).__name__, "executor": type(executor).__name__, "worker": type(worker).__name__,
        "device": str(worker.device), "num_gpu_blocks": llm.engine.cache_sizes.num_gpu_blocks,
        "cuda_graphs": list(worker.cuda_graphs), "static_decode_runs": None if static is None else dict(static.runs),
        "warmed_up_variants": len(worker.warmed_up),
    }


def engine_path_problems(path: dict, options: dict, device: str) -> list[str]:
    """Where the engine did not take the path the options ask for."""
    problems = []
    if (path["engine"], path["executor"], path["worker"]) != ("LLMEngine", "InProcessExecutor", "Worker"):
        problems.append(f"engine path {path['engine']} / {path['executor']} / {path['worker']}")
    expected_device = "cuda:0" if device == "cuda" else "cpu"
    if path["device"] != expected_device:
        problems.append(f"the worker ran on {path['device']}, not {expected_device}")
    runs = path["static_decode_runs"]
    if options.get("enforce_eager"):
        if runs is not None or path["cuda_graphs"]:
            problems.append("enforce_eager, yet a static decode path or CUDA graphs were built")
    elif runs is None:
        problems.append("no static decode path without enforce_eager")
    elif device == "cuda" and options.get("attention_backend") == "triton":
        if not path["cuda_graphs"] or runs["graph"] == 0:
            problems.append(f"CUDA graphs on, yet graphs {path['cuda_graphs']} and {runs['graph']} graph replays")
    elif runs["eager"] == 0:
        problems.append("the static decode path ran no step")
    return problems


# ---------------------------------------------------------------------------- report


def format_table(report: dict) -> str:
    lines = ["", "== gpu_check summary =="]
    env = report["environment"]
    device = env.get("device", "no CUDA device (CPU only)")
    lines.append(f"device            {device}; torch {env['torch']}, triton {env.get('triton')}")
    if not env.get("cuda", True):
        lines.append("GPU parts         SKIPPED (no CUDA device): only the CPU-checkable parts below ran")
    tests = report.get("tests")
    if tests:
        where = "CPU, Triton interpreter" if tests["interpreter"] else "GPU, compiled"
        lines.append(f"tests             {tests['summary']} ({where}{', -m quick' if report['quick'] else ''})")
    memcheck = report.get("memcheck")
    if memcheck:
        verdict = "clean" if memcheck["clean"] else f"FAILED ({memcheck['sanitizer_errors']} errors reported)"
        lines.append(f"memcheck          {verdict}: {memcheck['summary']} (compute-sanitizer, -m quick)")
    copy = report.get("copy_bandwidth")
    if copy:
        gib = copy["bytes"] / 2**30
        lines.append(f"copy bandwidth    {copy['gbps']:.0f} GB/s (read + write, {gib:.0f} GiB tensor)")
    decode = [row for row in report.get("decode", []) if "ms" in row]
    if decode:
        lines.append(
            "decode            dtype     batch context rule picks        ms    GB/s  %copy  paged/dense"
            "  single_ms  partitioned_ms"
        )
        for row in decode:
            fraction = row.get("fraction_of_copy_bandwidth")
            lines.append(
                f"                  {row['dtype']:<9} {row['batch']:>5} {row['context']:>7} {row['variant']:<11}"
                f" {row['ms']:>8.4f} {row['gbps']:>7.0f} {100 * fraction if fraction else float('nan'):>5.1f}%"
                f" {row.get('paged_over_dense', float('nan')):>12.2f} {row['single_ms']:>10.4f}"
                f" {row['partitioned_ms']:>15.4f}"
            )
    prefill = [row for row in report.get("prefill", []) if "ms" in row]
    if prefill:
        lines.append("prefill           dtype     seqs context   new       ms  TFLOP/s  paged/dense")
        for row in prefill:
            lines.append(
                f"                  {row['dtype']:<9} {row['num_seqs']:>4} {row['context']:>7} {row['new_tokens']:>5}"
                f" {row['ms']:>8.3f} {row['tflops']:>8.1f} {row.get('paged_over_dense', float('nan')):>8.2f}"
            )
    quant = report.get("quant")
    if quant:
        lines.append(f"quant             {quant['device']}: rows, layer, kernel, max error / bound, ms (bf16 F.linear ms)")
        for row in quant["rows"]:
            timing = f" {row['ms']:.4f} ({row['bf16_ms']:.4f})" if "ms" in row else ""
            lines.append(f"                  {row['rows']:>4} {row['layer']:<5} {row['kernel']:<22} "
                         f"{row['error_over_bound']:.3f}{timing}")  # fmt: skip
    lines += _runner_lines(report.get("runner"))
    lines += _e2e_lines(report.get("e2e"))
    for name, why in report["skipped"].items():
        lines.append(f"SKIPPED           {name}: {why}")
    for name, error in report["errors"].items():
        lines.append(f"ERROR             {name}: {error}")
    return "\n".join(lines)


def _e2e_lines(e2e: dict | None) -> list[str]:
    if not e2e:
        return []
    lines = [f"e2e               {e2e['model']}, {e2e['dtype']}"]

    def label(backend: str) -> str:
        return "triton (interpreter)" if backend == "triton" and e2e.get("device") == "cpu" else backend

    for key, value in sorted(e2e.items()):
        if key.startswith("hf_parity_"):
            backend = label(key.removeprefix("hf_parity_"))
            lines.append(
                f"  vs HF greedy    {backend}: {value['exact_match_rate']:.0%} of {value['prompts']} prompts exact, "
                f"{value['token_match_rate']:.0%} of tokens"
            )
        elif key.startswith("throughput_"):
            backend = label(key.removeprefix("throughput_"))
            lines.append(
                f"  tokens/s        {backend}: {value['output_tokens_per_s']:.1f} output "
                f"tokens/s ({value['num_prompts']} prompts x {value['max_tokens']} tokens)"
            )
        elif key.startswith("engine_path_"):
            backend = label(key.removeprefix("engine_path_"))
            runs = value["static_decode_runs"]
            lines.append(
                f"  engine path     {backend}: {value['executor']} -> {value['worker']} on {value['device']}, "
                f"{value['num_gpu_blocks']} KV blocks, graphs {value['cuda_graphs'] or 'none'}, "
                f"static decode {runs if runs is not None else 'off (enforce_eager)'}"
            )
    for failure in e2e.get("failures", []):
        lines.append(f"  FAILED          {failure}")
    if "triton_over_torch_tokens_per_s" in e2e:
        lines.append(f"  triton / torch  {e2e['triton_over_torch_tokens_per_s']:.2f}x output tokens/s")
    if "cuda_graphs_over_eager_tokens_per_s" in e2e:
        lines.append(f"  graphs / eager  {e2e['cuda_graphs_over_eager_tokens_per_s']:.2f}x output tokens/s (triton)")
    return lines


def _runner_lines(runner: dict | None) -> list[str]:
    if not runner:
        return []
    lines = [f"runner            {runner.get('model')}, {runner['backend']} on {runner['device']}"]
    parity = runner.get("hf_parity_float32")
    if parity:
        lines.append(f"  vs HF greedy    float32: {parity['exact']} of {parity['prompts']} prompts exact")
    for dtype, equal in runner.get("static_decode_equal", {}).items():
        graphs = runner.get("static_decode_graphs", {}).get(dtype) or "none (eager on padded rows)"
        lines.append(f"  static decode   {dtype}: tokens {'equal to' if equal else 'DIFFER from'} eager; graphs {graphs}")
    for dtype, row in runner.get("decode_tokens_per_s", {}).items():
        lines.append(
            f"  tokens/s        {dtype}: graphs off {row['graphs_off']['tokens_per_s']:.0f}, on "
            f"{row['graphs_on']['tokens_per_s']:.0f} ({row['graphs_on_over_off']:.2f}x; batch {row['batch']}); "
            f"graph memory {row['graph_memory_mib']['held']} MiB held, {row['graph_memory_mib']['reserved']} reserved"
        )
    for failure in runner.get("failures", []):
        lines.append(f"  FAILED          {failure}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
