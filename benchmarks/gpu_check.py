"""Triton kernels and the engine on a GPU: bandwidth, decode, prefill, int4 GEMM, engine steps, tests, memcheck.

    python benchmarks/gpu_check.py OUT_DIR --quick      # the run plan below, under 5 minutes on one H200
    python benchmarks/gpu_check.py OUT_DIR              # the full run (a second, optional command)
        [--only SECTION ...] [--skip-tests] [--skip-e2e] [--cpu-backend triton|torch] [--wheels DIR]

First the Python version and every package version are printed; then the wheels are
installed where the engine's packages do not import (section `wheels`); then the sections of
PLAN run in its order (`--quick`: the quick ones), each one's result or error written to
OUT_DIR/gpu_check.json as soon as it ends (a kill at the machine's timeout keeps what ran),
and a short table is printed last. No section's failure stops the others.

With CUDA, --quick (the time each takes on one H200 is PLAN's estimate; docs/KERNELS.md says
how each was got):
  copy_bandwidth  device-to-device copy of a 2 GiB tensor (bytes read + written per second):
                  the roofline the attention figures are compared with
  decode          paged decode attention, float16 and bfloat16, batch 1/64 x context 512/8192
                  (full: batch 1/16/64/256 x 512/2048/8192), 32 query / 8 kv heads, head 128,
                  block 16, blocks scattered at random: both variants and the rule's pick, GB/s,
                  share of the copy bandwidth, torch SDPA on the same K/V laid out contiguously;
                  timed L2-cold (replays rotate over copies of the inputs that together exceed
                  4x the L2), a point whose working set fits in L2 flagged
  prefill         paged prefill attention with and without cached context: TFLOP/s, vs SDPA
  quant           the int4 Triton GEMM (g=128) and FP8 against bfloat16 F.linear on 4096x4096
                  at decode (1, 16 rows) and prefill (256 rows) shapes, L2-cold, with its error
  e2e             one small float16 checkpoint (OPT-1.3B's width, 4 layers) through
                  LLM -> LLMEngine -> InProcessExecutor -> Worker with CUDA graphs and with
                  enforce_eager: greedy parity against HF generate, tokens/s, the path taken
The full run adds: the torch backend in e2e; runner (load_model + ModelRunner on the same
checkpoint: float32 HF parity, swap round trip, static decode, KV sizing, no compile after
warm-up, graphs on/off); tests (the Triton tests compiled on the GPU); memcheck (the quick
tests under compute-sanitizer, in its own session, killed as a group; after the timed parts).

Without CUDA it runs what a CPU can (quant errors, runner and e2e on the tiny OPT, the
interpreter tests unless --skip-tests) and records the GPU parts as skipped.

The engine step needs pydantic, the OpenTelemetry SDK, prometheus-client and llguidance,
which a bare GPU image lacks: where they do not import (checked by really importing them, in
a subprocess), the wheels in DIR (default .whl/ in the repository; the pinned list is
benchmarks/gpu_check_wheels.txt) are installed into a temporary folder, for each
distribution the wheel whose tags this interpreter supports best, so one folder can hold
wheels for several CPython versions, e.g. after

    for v in 3.10 3.11 3.12 3.13; do python -m pip download --no-deps --only-binary=:all: \\
        --python-version $v --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 \\
        -d .whl -r benchmarks/gpu_check_wheels.txt; done

A wheel pip refuses is an error of the `wheels` section; the other sections still run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import gpu_e2e, gpu_kernels  # noqa: E402  (stdlib only at import: torch comes after the wheels)
from benchmarks.records import write_json  # noqa: E402


@dataclass(frozen=True)
class Section:
    name: str
    quick_s: float  # estimated seconds on one H200 with --quick (0: not in the quick run)
    full_s: float  # estimated seconds in the full run
    cpu: bool  # runs without CUDA (else recorded as skipped there)


# The run plan, in order: the timed sections first, memcheck last (a sanitizer run must not
# overlap a timed one). Estimates (seconds on one H200, first run, empty Triton cache): the
# kernel variants each section compiles x 3-5 s each (sm_90 compile times measured on CPU by
# ops/triton_aot.py) plus its timed work from bytes moved at ~4 TB/s x repeats, plus model
# load and capture for the engine; docs/KERNELS.md has the arithmetic per section.
PLAN = (
    Section("copy_bandwidth", 5, 5, cpu=False),
    Section("decode", 45, 90, cpu=False),
    Section("prefill", 20, 40, cpu=False),
    Section("quant", 20, 25, cpu=True),
    Section("e2e", 90, 150, cpu=True),
    Section("runner", 0, 120, cpu=True),
    Section("tests", 0, 200, cpu=True),
    Section("memcheck", 0, 60, cpu=False),
)
SECTIONS = {section.name: section for section in PLAN}
QUICK_LIMIT_S = 300  # the quick plan's estimates must stay under this (asserted by the tests)
# What the engine step imports beyond torch, triton, transformers and safetensors, with the
# distributions benchmarks/gpu_check_wheels.txt pins for them.
ENGINE_MODULES = (
    "pydantic", "opentelemetry.sdk", "opentelemetry.exporter.prometheus", "prometheus_client", "llguidance",
)
DEFAULT_WHEELS = REPO_ROOT / ".whl"
WHEEL_LIST = REPO_ROOT / "benchmarks" / "gpu_check_wheels.txt"
# printed (and recorded) first: what the GPU image brings, then what the wheels bring
BASE_DISTRIBUTIONS = (
    "torch", "triton", "transformers", "safetensors", "tokenizers", "numpy", "pytest", "hypothesis", "peft", "packaging",
    "pip",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory for gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="the quick plan: under 5 minutes on one H200")
    parser.add_argument("--only", action="append", choices=list(SECTIONS), help="run only these sections")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the Triton kernel tests or memcheck")
    parser.add_argument("--skip-e2e", action="store_true", help="do not run the runner and engine sections")
    parser.add_argument(
        "--cpu-backend", choices=("triton", "torch"), default="triton",
        help="without CUDA: the runner check's attention backend (triton = the interpreted kernels)",
    )
    parser.add_argument(
        "--wheels", type=Path, default=DEFAULT_WHEELS,
        help="wheels installed (into a temporary folder) when the engine step's packages do not import",
    )
    return parser.parse_args(argv)


def planned(args: argparse.Namespace, has_cuda: bool) -> tuple[list[str], dict[str, str]]:
    """(sections to run in order, {section: why skipped}) for these arguments and device."""
    run, skipped = [], {}
    for section in PLAN:
        name = section.name
        if args.only and name not in args.only:
            continue
        if args.skip_tests and name in ("tests", "memcheck"):
            skipped[name] = "--skip-tests"
        elif args.skip_e2e and name in ("runner", "e2e"):
            skipped[name] = "--skip-e2e"
        elif not has_cuda and not section.cpu:
            skipped[name] = "no CUDA device: GPU parts skipped"
        elif args.quick and not section.quick_s and has_cuda:  # on CPU time is not the limit: all that runs
            skipped[name] = "not in the --quick plan (the full run has it)"
        else:
            run.append(name)
    return run, skipped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # a timeout's SIGTERM ends the run through the finally below (temporary folders removed);
    # every finished section is in the report already
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    packages = package_versions()
    print(f"[gpu_check] python {platform.python_version()} ({sys.executable})", flush=True)
    print("[gpu_check] " + ", ".join(f"{name} {version}" for name, version in packages.items()), flush=True)
    report: dict = {"quick": args.quick, "environment": {"python": platform.python_version(), "packages": packages},
                    "plan": [], "skipped": {}, "errors": {}, "step_seconds": {}}  # fmt: skip
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # the shared checkpoint; removed at the end
    wheels: dict = {"missing_before": [], "installed": [], "missing": []}
    try:
        wheels = run_section(report, args.out_dir, "wheels", lambda: bring_wheels(args.wheels))
        if wheels is None:
            wheels = {"missing_before": [], "installed": [], "missing": list(ENGINE_MODULES)}
            report["wheels"] = wheels
        wheel_errors = wheel_problems(wheels)
        if wheel_errors:
            report["errors"]["wheels"] = wheel_errors
        report["environment"]["packages"] = package_versions()  # the wheels' versions too
        return run_plan(report, args, wheels, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if wheels.get("target"):
            shutil.rmtree(wheels["target"], ignore_errors=True)


def run_plan(report: dict, args: argparse.Namespace, wheels: dict, scratch: Path) -> int:
    import torch  # after the wheels: a newer typing_extensions must load first

    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU e2e runs the kernels too
    report["environment"] |= environment(torch)
    names, report["skipped"] = planned(args, has_cuda)
    report["plan"] = [{"section": n, "estimate_s": estimate(n, args.quick) if has_cuda else None} for n in names]
    save(report, args.out_dir)
    context = gpu_e2e.Checkpoints(scratch, has_cuda)
    deadline = gpu_kernels.Deadline(gpu_kernels.BENCH_BUDGET_S["quick" if args.quick else "full"])
    sections = {
        "copy_bandwidth": lambda: gpu_kernels.copy_bandwidth(torch),
        "decode": lambda: gpu_kernels.decode_benchmark(
            torch, args.quick, report.get("copy_bandwidth", {}).get("gbps"), deadline
        ),
        "prefill": lambda: gpu_kernels.prefill_benchmark(torch, args.quick, deadline),
        "quant": lambda: gpu_kernels.quant_check(torch, has_cuda),
        "e2e": lambda: e2e_section(torch, has_cuda, args.quick, wheels, context, args.wheels),
        "runner": lambda: gpu_e2e.runner_check(torch, has_cuda, args.quick, args.cpu_backend, context),
        "tests": lambda: gpu_kernels.run_tests(has_cuda, args.quick),
        "memcheck": lambda: memcheck_section(),
    }
    for name in names:
        run_section(report, args.out_dir, name, sections[name], estimate(name, args.quick) if has_cuda else None)
    path = save(report, args.out_dir)
    print(format_table(report))
    print(f"full figures: {path}")
    tests_failed = any((report.get(name) or {}).get("returncode", 0) != 0 for name in ("tests", "memcheck"))
    failed = any((report.get(name) or {}).get("failures") for name in ("runner", "e2e", "quant"))
    return 1 if tests_failed or failed or report["errors"] else 0


def estimate(name: str, quick: bool) -> float:
    section = SECTIONS[name]
    return section.quick_s if quick else section.full_s


def e2e_section(torch, has_cuda: bool, quick: bool, wheels: dict, context, wheel_dir: Path):
    if wheels["missing"]:
        raise SkipSection(
            f"the engine (LLM) needs {', '.join(wheels['missing'])}, which do not import, and {wheel_dir} "
            "holds no wheels that provide them (benchmarks/gpu_check_wheels.txt lists them)"
        )
    return gpu_e2e.e2e_gpu(torch, quick, context) if has_cuda else gpu_e2e.e2e_cpu(torch, context)


def memcheck_section() -> dict:
    sanitizer = gpu_kernels.find_compute_sanitizer()
    why_not = gpu_kernels.memcheck_skip_reason(True, sanitizer)
    if why_not:
        raise SkipSection(why_not)
    return gpu_kernels.run_memcheck(sanitizer, quick=True)


class SkipSection(Exception):
    """A section that cannot run here: recorded under "skipped" with this reason."""


def run_section(report: dict, out_dir: Path, name: str, fn, estimate_s: float | None = None):
    """Run one section: its result under report[name] (None on failure), an error under
    report["errors"], a skip under report["skipped"]; its time next to its estimate; the
    report written at once. Returns the result."""
    print(f"[gpu_check] {name} (estimate {estimate_s} s) ...", flush=True)
    started = time.monotonic()
    result = None
    try:
        result = report[name] = fn()
    except SkipSection as why:
        report["skipped"][name] = str(why)
    except Exception as error:  # one broken section must not hide the others' figures
        report["errors"][name] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    seconds = round(time.monotonic() - started, 1)
    report["step_seconds"][name] = {"seconds": seconds, "estimate": estimate_s}
    print(f"[gpu_check] {name} done in {seconds}s (estimate {estimate_s} s)", flush=True)
    save(report, out_dir)
    return result


def save(report: dict, out_dir: Path) -> str:
    return write_json(out_dir, "gpu_check.json", report)


# ---------------------------------------------------------------------------- wheels


def not_importable(modules: tuple[str, ...] | list[str]) -> list[str]:
    """The modules that fail to import, each tried for real in a fresh interpreter (this
    process's sys.path first, as PYTHONPATH): a module found but broken counts as missing."""
    if not modules:
        return []
    code = (
        "import importlib, json, sys\nbad = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception:\n        bad.append(name)\n"
        "print(json.dumps(bad))\n"
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run([sys.executable, "-c", code, *modules], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tempfile.gettempdir())  # fmt: skip
        return json.loads(done.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - the probe itself broke: nothing counts as importable
        return list(modules)


def supported_tags() -> list[tuple[str, str, str]]:
    """This interpreter's wheel tags, best first (packaging's, or pip's vendored copy)."""
    try:
        from packaging.tags import sys_tags
    except ImportError:
        from pip._vendor.packaging.tags import sys_tags
    return [(tag.interpreter, tag.abi, tag.platform) for tag in sys_tags()]


def wheel_tags(path: Path) -> tuple[str, set[tuple[str, str, str]]]:
    """(normalized distribution name, the tags) of a wheel file name
    `{name}-{version}(-{build})?-{python}-{abi}-{platform}.whl`."""
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        return parts[0].lower().replace("_", "-"), set()
    python, abi, plat = parts[-3:]
    tags = {(i, a, p) for i in python.split(".") for a in abi.split(".") for p in plat.split(".")}
    return parts[0].lower().replace("_", "-").replace(".", "-"), tags


def choose_wheels(wheels: list[Path], tags: list[tuple[str, str, str]]) -> tuple[list[Path], list[str]]:
    """Per distribution, the wheel with the best-ranked tag this interpreter supports;
    (chosen wheels, distributions that have none that fits)."""
    rank = {tag: i for i, tag in enumerate(tags)}
    best: dict[str, tuple[int, Path]] = {}
    seen = []
    for wheel in wheels:
        name, its_tags = wheel_tags(wheel)
        seen.append(name)
        fits = [rank[tag] for tag in its_tags if tag in rank]
        if fits and (name not in best or min(fits) < best[name][0]):
            best[name] = (min(fits), wheel)
    unfit = sorted({name for name in seen if name not in best})
    return [wheel for _, wheel in sorted(best.values(), key=lambda item: item[1].name)], unfit


def install_wheels(wheels: list[Path], target: Path) -> dict[str, str]:
    """pip install the wheels into `target` (no index, no dependencies: the folder holds
    them); all at once, and if pip refuses, one by one. {wheel name: why} for each refused."""
    def pip(paths: list[Path]) -> str | None:
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--disable-pip-version-check", "--target", str(target), *map(str, paths)]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return "pip timed out after 300 s"
        return None if done.returncode == 0 else (done.stderr.strip() or done.stdout.strip())[-600:]

    if pip(wheels) is None:
        return {}
    refused = {}
    for wheel in wheels:
        why = pip([wheel])
        if why is not None:
            refused[wheel.name] = why
    return refused


def bring_wheels(wheel_dir: Path | None, modules: tuple[str, ...] = ENGINE_MODULES) -> dict:
    """Make `modules` importable: where one is not, install the wheels of `wheel_dir` that fit
    this interpreter (choose_wheels) into a temporary folder put first on sys.path and on
    PYTHONPATH (for the subprocesses). Returns what was missing before, what was installed,
    what is still missing and, where any, the wheels pip refused and the distributions
    without a wheel that fits; never raises for a bad wheel."""
    missing = not_importable(modules)
    result: dict = {"missing_before": missing, "installed": [], "missing": missing}
    found = sorted(wheel_dir.glob("*.whl")) if missing and wheel_dir is not None and wheel_dir.is_dir() else []
    if not found:
        return result
    chosen, unfit = choose_wheels(found, supported_tags())
    if unfit:
        result["no_fitting_wheel"] = unfit
    if not chosen:
        return result
    target = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    refused = install_wheels(chosen, target)
    if refused:
        result["refused"] = refused
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(target), os.environ.get("PYTHONPATH"))))
    importlib.invalidate_caches()
    result |= {
        "installed": [wheel.name for wheel in chosen if wheel.name not in refused], "target": str(target),
        "missing": not_importable(modules),
    }
    return result


def wheel_problems(wheels: dict) -> str | None:
    """The wheels section's error text: refused wheels and distributions without a fitting wheel."""
    problems = [f"pip refused {name}: {why.splitlines()[-1] if why else ''}" for name, why in
                wheels.get("refused", {}).items()]  # fmt: skip
    if wheels.get("no_fitting_wheel"):
        problems.append(f"no wheel fits Python {platform.python_version()} for {', '.join(wheels['no_fitting_wheel'])}")
    return "; ".join(problems) or None


def package_versions() -> dict[str, str]:
    """Versions of the GPU image's packages and of every distribution the wheel list pins
    ("absent" where not installed)."""
    from importlib import metadata

    names = list(BASE_DISTRIBUTIONS)
    if WHEEL_LIST.is_file():
        for line in WHEEL_LIST.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                names.append(line.split("==")[0].strip())
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def environment(torch) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as error:
        info["triton"] = f"not importable: {error}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"device": props.name, "num_sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
                 "l2_bytes": gpu_kernels.l2_bytes(torch)}  # fmt: skip
    return info


def format_table(report: dict) -> str:
    lines = ["", "== gpu_check summary =="]
    env = report["environment"]
    device = env.get("device", "no CUDA device (CPU only)")
    lines.append(f"device            {device}; python {env.get('python')}, torch {env.get('torch')}, "
                 f"triton {env.get('triton')}")  # fmt: skip
    if not env.get("cuda", True):
        lines.append("GPU parts         SKIPPED (no CUDA device): only the CPU-checkable parts below ran")
    for name, row in report.get("step_seconds", {}).items():
        lines.append(f"time              {name}: {row['seconds']} s (estimate {row['estimate']} s)")
    lines += gpu_kernels.report_lines(report)
    lines += gpu_e2e.report_lines(report)
    for name, why in report["skipped"].items():
        lines.append(f"SKIPPED           {name}: {why}")
    for name, error in report["errors"].items():
        lines.append(f"ERROR             {name}: {error}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
