"""Triton kernels on a GPU: tests, memcheck, decode and prefill timing, the engine end to end.

    python benchmarks/gpu_check.py OUT_DIR [--quick] [--skip-tests] [--skip-e2e] [--cpu-backend B] [--wheels DIR]

With CUDA (sized for one H200, under 8 minutes; --quick does less of each):
  tests    pytest tests/ops/test_triton.py (attention) and tests/ops/test_triton_lora.py (the LoRA
           kernels) compiled on the GPU (RAYSERVE_PAGED_TRITON_TEST_DEVICE=cuda)
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
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import gpu_e2e, gpu_kernels  # noqa: E402  (stdlib only at import: torch comes after the wheels)
from benchmarks.records import write_json  # noqa: E402

# Wall-clock guard that keeps a full run under 8 minutes (with the test runs' own timeouts,
# gpu_kernels.TESTS_TIMEOUT_S / MEMCHECK_TIMEOUT_S): no new copy / decode / prefill point
# starts after BENCH_BUDGET_S.
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory for gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="fewer tests, shapes, repeats and layers")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the Triton kernel tests")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    wheels = bring_wheels(args.wheels)  # before torch: a newer typing_extensions must load first
    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU e2e runs the kernels too
    report: dict = {
        "environment": environment(torch), "quick": args.quick, "skipped": {}, "errors": {}, "wheels": wheels,
    }
    kernel_check(report, torch, has_cuda, args)
    e2e_check(report, torch, has_cuda, args, wheels)
    path = write_json(args.out_dir, "gpu_check.json", report)
    print(format_table(report))
    print(f"full figures: {path}")
    tests_failed = any(report.get(name, {}).get("returncode", 0) != 0 for name in ("tests", "memcheck"))
    failed = any(report.get(name, {}).get("failures") for name in ("runner", "e2e", "quant"))
    return 1 if tests_failed or failed or report["errors"] else 0


def kernel_check(report: dict, torch, has_cuda: bool, args: argparse.Namespace) -> None:
    """The kernels: tests and memcheck, the quantized layers, then (on CUDA) copy bandwidth,
    decode and prefill."""
    if args.skip_tests:
        report["skipped"]["tests"] = report["skipped"]["memcheck"] = "--skip-tests"
    else:
        run_section(report, "tests", lambda: gpu_kernels.run_tests(has_cuda, args.quick))
        sanitizer = gpu_kernels.find_compute_sanitizer()
        why_not = gpu_kernels.memcheck_skip_reason(has_cuda, sanitizer)
        if why_not:
            report["skipped"]["memcheck"] = why_not
        else:
            run_section(report, "memcheck", lambda: gpu_kernels.run_memcheck(sanitizer, args.quick))
    run_section(report, "quant", lambda: gpu_kernels.quant_check(torch, has_cuda))
    if not has_cuda:
        for name in ("copy_bandwidth", "decode", "prefill", "e2e_opt_1.3b_shaped"):
            report["skipped"][name] = "no CUDA device: GPU parts skipped"
        return
    deadline = gpu_kernels.Deadline(BENCH_BUDGET_S["quick" if args.quick else "full"])
    run_section(report, "copy_bandwidth", lambda: gpu_kernels.copy_bandwidth(torch))
    copy_gbps = report.get("copy_bandwidth", {}).get("gbps")
    run_section(report, "decode", lambda: gpu_kernels.decode_benchmark(torch, args.quick, copy_gbps, deadline))
    run_section(report, "prefill", lambda: gpu_kernels.prefill_benchmark(torch, args.quick, deadline))


def e2e_check(report: dict, torch, has_cuda: bool, args: argparse.Namespace, wheels: dict) -> None:
    """The model runner without the engine, then the engine path (where its packages import)."""
    if args.skip_e2e:
        report["skipped"]["e2e"] = report["skipped"]["runner"] = "--skip-e2e"
        return
    run_section(report, "runner", lambda: gpu_e2e.runner_check(torch, has_cuda, args.quick, args.cpu_backend))
    if wheels["missing"]:
        report["skipped"]["e2e"] = (
            f"the engine (LLM) needs {', '.join(wheels['missing'])}, which do not import, and {args.wheels} "
            "holds no wheels that provide them (benchmarks/gpu_check_wheels.txt lists them)"
        )
    elif has_cuda:
        run_section(report, "e2e", lambda: gpu_e2e.e2e_gpu(torch, args.quick))
    else:
        run_section(report, "e2e", lambda: gpu_e2e.e2e_cpu(torch))


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


def format_table(report: dict) -> str:
    lines = ["", "== gpu_check summary =="]
    env = report["environment"]
    device = env.get("device", "no CUDA device (CPU only)")
    lines.append(f"device            {device}; torch {env['torch']}, triton {env.get('triton')}")
    if not env.get("cuda", True):
        lines.append("GPU parts         SKIPPED (no CUDA device): only the CPU-checkable parts below ran")
    lines += gpu_kernels.report_lines(report)
    lines += gpu_e2e.report_lines(report)
    for name, why in report["skipped"].items():
        lines.append(f"SKIPPED           {name}: {why}")
    for name, error in report["errors"].items():
        lines.append(f"ERROR             {name}: {error}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
