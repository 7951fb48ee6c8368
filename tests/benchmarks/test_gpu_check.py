"""benchmarks/gpu_check.py's CPU part, as the GPU image runs it: every module that image lacks
(pydantic, pydantic-core, OpenTelemetry, prometheus-client, llguidance, ray) hidden from the
interpreter, and the wheels of benchmarks/gpu_check_wheels.txt carried (made here from the
installed distributions, at the pinned versions). (The measurement code's own tests are in
tests/ops/test_triton.py, which gpu_check runs compiled on the GPU.)"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_e2e, gpu_kernels

ROOT = Path(__file__).resolve().parents[2]
# the top-level modules a GPU image without this project's serving stack lacks
IMAGE_LACKS = (
    "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "opentelemetry", "prometheus_client",
    "llguidance", "ray",
)
# found only outside this environment's site-packages (i.e. in gpu_check's wheel folder), if at all
HIDE = """
import os, sys
from importlib.machinery import PathFinder

HIDDEN = set(os.environ["GPU_CHECK_TEST_HIDE"].split(","))
SITE = {os.path.realpath(p) for p in os.environ["GPU_CHECK_TEST_HIDE_FROM"].split(os.pathsep)}


class HideFromSite:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if "." in name or name not in HIDDEN:
            return None
        spec = PathFinder.find_spec(name, [p for p in sys.path if os.path.realpath(p or ".") not in SITE])
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return spec


sys.meta_path.insert(0, HideFromSite)
"""


def hiding_env(folder: Path, hidden: tuple[str, ...]) -> dict:
    """An environment whose interpreters (and their subprocesses) cannot import `hidden`
    from site-packages: a sitecustomize on PYTHONPATH; no CUDA device visible."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(HIDE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return env | {
        "PYTHONPATH": os.pathsep.join(filter(None, (str(folder), env.get("PYTHONPATH")))),
        "GPU_CHECK_TEST_HIDE": ",".join(hidden), "GPU_CHECK_TEST_HIDE_FROM": os.pathsep.join(site.getsitepackages()),
        "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
    }


def run_gpu_check(tmp: Path, wheels: Path, *extra: str, returncode: int = 0) -> dict:
    """gpu_check's CPU part (--quick --skip-tests, torch backend) in a fresh interpreter that
    cannot import IMAGE_LACKS from site-packages; its JSON report."""
    out = tmp / "out"
    command = [sys.executable, "benchmarks/gpu_check.py", str(out), "--quick", "--skip-tests", "--cpu-backend", "torch",
               "--wheels", str(wheels), *extra]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=hiding_env(tmp / "hide", IMAGE_LACKS), capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == returncode, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.index("[gpu_check] python ") < result.stdout.index("[gpu_check] wheels")  # versions first
    return json.loads((out / "gpu_check.json").read_text())


def pinned() -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in gpu_check.WHEEL_LIST.read_text().splitlines()]
    return dict(line.split("==") for line in lines if line)


def repack_wheel(name: str, folder: Path) -> Path:
    """The installed distribution `name` as a wheel again (its files, its dist-info, its
    WHEEL tags), the way pip download would have brought it."""
    dist = metadata.distribution(name)
    tags = [line.split(":", 1)[1].strip() for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag:")]
    parts = [sorted({tag.split("-")[i] for tag in tags}) for i in range(3)]
    stem = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{'-'.join('.'.join(p) for p in parts)}"
    files = [f for f in dist.files if not f.parts[0] == ".." and "__pycache__" not in f.parts
             and f.name not in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")]  # fmt: skip
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    path = folder / f"{stem}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for file in files:
            archive.write(file.locate(), str(file))
        archive.writestr(f"{info}/RECORD", "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n")
    return path


@pytest.fixture(scope="module")
def carried_wheels(tmp_path_factory) -> Path:
    """benchmarks/gpu_check_wheels.txt as wheels, from this environment (whose versions must
    be the pinned ones: the list stays the set the project is tested with)."""
    folder = tmp_path_factory.mktemp("wheels")
    for name, version in pinned().items():
        assert metadata.version(name) == version, f"{name}: {metadata.version(name)} installed, {version} pinned"
        repack_wheel(name, folder)
    return folder


def assert_runner_passed(runner: dict) -> None:
    assert runner["failures"] == [] and runner["hf_parity_float32"] == {"prompts": 4, "exact": 4}
    assert runner["swap_roundtrip_equal"] == {"float32": True} and runner["backend"] == "torch"
    # the static-shape decode path ran (padded, eagerly: no CUDA here) and gave the eager tokens
    assert runner["static_decode_equal"] == {"float32": True} and runner["static_decode_graphs"] == {"float32": []}
    assert runner["static_decode_runs"]["float32"]["eager"] > 0 == runner["static_decode_runs"]["float32"]["graph"]


def test_cpu_part_runs_the_engine_step_on_the_carried_wheels(tmp_path, carried_wheels):
    """Nothing the image lacks importable but from the carried wheels: they are installed,
    then the runner check and the engine step (LLM -> LLMEngine -> InProcessExecutor ->
    Worker, the static decode path on and off, the interpreted triton kernels) each give
    HF's float32 greedy tokens; the temporary folders are gone after the run."""
    report = run_gpu_check(tmp_path, carried_wheels)
    wheels = report["wheels"]
    assert wheels["missing_before"] == list(gpu_check.ENGINE_MODULES) and wheels["missing"] == []
    assert len(wheels["installed"]) == len(pinned()) and "refused" not in wheels
    assert not Path(wheels["target"]).exists()
    assert {k: report["environment"]["packages"][k] for k in pinned()} == pinned()
    assert report["errors"] == {} and set(report["skipped"]) == {"copy_bandwidth", "decode", "prefill", "tests",
                                                                  "memcheck"}  # fmt: skip
    assert [row["section"] for row in report["plan"]] == ["quant", "e2e", "runner"]
    assert_runner_passed(report["runner"])
    e2e = report["e2e"]
    assert e2e["failures"] == [] and e2e["device"] == "cpu"
    for label in ("torch", "torch:eager", "triton"):
        assert e2e[f"hf_parity_{label}"]["exact_match_rate"] == 1.0
        path = e2e[f"engine_path_{label}"]
        assert (path["engine"], path["executor"], path["worker"], path["device"]) == (
            "LLMEngine", "InProcessExecutor", "Worker", "cpu"
        )
        assert path["cuda_graphs"] == [] and path["num_gpu_blocks"] > 0
    assert e2e["engine_path_torch:eager"]["static_decode_runs"] is None
    for label in ("torch", "triton"):
        assert e2e[f"engine_path_{label}"]["static_decode_runs"]["eager"] > 0
    assert set(report["step_seconds"]) == {"wheels", "quant", "e2e", "runner"}


def test_a_refused_wheel_is_an_error_of_its_own_and_the_run_goes_on(tmp_path, carried_wheels):
    """A wheel pip refuses (an archive without its metadata) and a distribution with no wheel
    for this Python: the wheels section's error, the wheel that fits installed, the engine
    step skipped with its reason (pydantic does not import), the other sections still run."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for wheel in carried_wheels.glob("prometheus_client-*.whl"):
        (folder / wheel.name).symlink_to(wheel)
    with zipfile.ZipFile(folder / "pydantic-2.14.4-py3-none-any.whl", "w") as archive:
        archive.writestr("pydantic/__init__.py", "")  # no .dist-info: not a wheel pip installs
    (folder / "annotated_types-0.8.0-cp27-cp27m-win32.whl").write_bytes(b"for another Python")
    report = run_gpu_check(tmp_path, folder, "--only", "quant", "--only", "e2e", returncode=1)
    wheels = report["wheels"]
    assert list(wheels["refused"]) == ["pydantic-2.14.4-py3-none-any.whl"]
    assert wheels["no_fitting_wheel"] == ["annotated-types"] and wheels["installed"][0].startswith("prometheus_client")
    assert "pydantic" in wheels["missing"] and "prometheus_client" not in wheels["missing"]
    assert set(report["errors"]) == {"wheels"} and not Path(wheels["target"]).exists()
    assert "pip refused pydantic-2.14.4-py3-none-any.whl" in report["errors"]["wheels"]
    assert "no wheel fits Python" in report["errors"]["wheels"]
    assert "pydantic" in report["skipped"]["e2e"] and "gpu_check_wheels.txt" in report["skipped"]["e2e"]
    assert report["quant"]["failures"] == [] and report["quant"]["rows"]


def make_wheel(folder: Path, module: str, version: str = "1.0", code: str = "VALUE = 42\n") -> Path:
    """A pure-Python wheel holding one module (by default one that defines VALUE = 42)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": code,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


def test_bring_wheels_installs_what_does_not_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/already/there")
    module = "gpu_check_wheel_probe"
    wheel = make_wheel(tmp_path / "wheels", module)
    result = gpu_check.bring_wheels(tmp_path / "wheels", modules=(module, "json"))
    assert result["missing_before"] == [module] and result["missing"] == []
    assert result["installed"] == [wheel.name]
    assert sys.path[0] == result["target"] and os.environ["PYTHONPATH"] == result["target"] + os.pathsep + "/already/there"
    assert __import__(module).VALUE == 42
    sys.modules.pop(module)
    # nothing missing: nothing installed, the path untouched
    assert gpu_check.bring_wheels(tmp_path / "wheels", modules=("json",)) == {
        "missing_before": [], "installed": [], "missing": []
    }


def test_bring_wheels_reports_what_stays_missing(tmp_path):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "absent", None):
        assert gpu_check.bring_wheels(folder, modules=("json", "no_such_module_here")) == {
            "missing_before": ["no_such_module_here"], "installed": [], "missing": ["no_such_module_here"]
        }


def test_a_module_that_is_found_but_fails_to_import_counts_as_missing(tmp_path, monkeypatch):
    """find_spec said yes to these (the engine step then died on ModuleNotFoundError)."""
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site"), *sys.path])
    (tmp_path / "site" / "gpu_check_broken_probe").mkdir(parents=True)
    (tmp_path / "site" / "gpu_check_broken_probe" / "__init__.py").write_text("import no_such_module_anywhere\n")
    assert gpu_check.not_importable(["json", "gpu_check_broken_probe", "os.path"]) == ["gpu_check_broken_probe"]


def test_wheels_are_chosen_by_the_tags_this_python_supports(tmp_path):
    tags = [("cp312", "cp312", "manylinux_2_17_x86_64"), ("cp312", "abi3", "manylinux_2_17_x86_64"),
            ("py3", "none", "any")]  # fmt: skip
    names = [
        "pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "pydantic_core-2.50.5-cp313-cp313-manylinux_2_17_x86_64.whl",
        "llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl",  # glibc 2.31 is not among the tags
        "pydantic-2.14.4-py3-none-any.whl",
        "Typing.Extensions-4.16.0-1build-py3-none-any.whl",
    ]
    chosen, unfit = gpu_check.choose_wheels([tmp_path / name for name in names], tags)
    assert [p.name for p in chosen] == [names[5], names[4], names[1]] and unfit == ["llguidance"]
    # this interpreter's own tags: its CPython's wheel among several
    version = f"cp{sys.version_info.major}{sys.version_info.minor}"
    many = [tmp_path / f"pkg-1.0-{v}-{v}-manylinux_2_17_x86_64.whl" for v in ("cp39", version, "cp399")]
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        assert gpu_check.choose_wheels(many, gpu_check.supported_tags()) == ([many[1]], [])


def test_a_timed_out_run_is_killed_with_its_process_group(tmp_path):
    """What a memcheck timeout must do: the sanitizer's child (here: a sleep) dies too."""
    pid_file = tmp_path / "child"
    with pytest.raises(TimeoutError, match="killed with its process group after 1 s"):
        gpu_kernels.run_in_session(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], 1)
    stat = Path(f"/proc/{pid_file.read_text().strip()}/stat")

    def dead() -> bool:  # gone, or dead and not yet reaped
        try:
            return stat.read_text().split(") ")[1][0] == "Z"
        except FileNotFoundError:
            return True

    # SIGKILL is sent to the group before the raise; the child's exit may still be under way
    # (its pipe closed, its state not yet Z) for a moment on a loaded machine: not 60 s
    deadline = time.monotonic() + 10
    while not dead() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dead()
    assert gpu_kernels.run_in_session(["sh", "-c", "echo ok"], 10) == (0, "ok\n", "")


def test_the_quick_plan_fits_its_limit_and_memcheck_comes_last(tmp_path):
    quick = [s for s in gpu_check.PLAN if s.quick_s]
    assert sum(s.quick_s for s in quick) < gpu_check.QUICK_LIMIT_S == 300
    assert [s.name for s in quick] == ["copy_bandwidth", "decode", "prefill", "quant", "e2e"]
    assert gpu_check.PLAN[-1].name == "memcheck"
    args = gpu_check.parse_args([str(tmp_path), "--quick"])
    run, skipped = gpu_check.planned(args, has_cuda=True)
    assert run == [s.name for s in quick] and set(skipped) == {"runner", "tests", "memcheck"}
    run, skipped = gpu_check.planned(gpu_check.parse_args([str(tmp_path)]), has_cuda=True)
    assert run == [s.name for s in gpu_check.PLAN] and skipped == {}
    run, skipped = gpu_check.planned(gpu_check.parse_args([str(tmp_path), "--quick", "--only", "e2e"]), True)
    assert run == ["e2e"] and skipped == {}


def test_points_whose_working_set_fits_in_l2_are_flagged():
    l2 = 50 * 2**20
    assert gpu_kernels.l2_flags(8 * 2**20, l2) == {"working_set_bytes": 8 * 2**20, "fits_l2": True, "l2_bytes": l2}
    assert not gpu_kernels.l2_flags(gpu_kernels.decode_bytes(64, 8192, 2), l2)["fits_l2"]
    # the decode points at batch 1 (and 16 x 512) fit; the int4 weight (8 MiB) would too
    fits = {(b, c) for b in gpu_kernels.DECODE_BATCHES for c in gpu_kernels.DECODE_CONTEXTS
            if gpu_kernels.l2_flags(gpu_kernels.decode_bytes(b, c, 2), l2)["fits_l2"]}  # fmt: skip
    assert fits == {(1, 512), (1, 2048), (1, 8192), (16, 512)}


def test_memcheck_is_skipped_with_its_reason_and_runs_under_the_sanitizer(tmp_path, monkeypatch):
    assert "no CUDA device" in gpu_kernels.memcheck_skip_reason(False, "/usr/local/cuda/bin/compute-sanitizer")
    assert "compute-sanitizer not found" in gpu_kernels.memcheck_skip_reason(True, None)
    assert gpu_kernels.memcheck_skip_reason(True, "/x/compute-sanitizer") is None
    # found on PATH, else in $CUDA_HOME/bin
    tool = tmp_path / "cuda" / "bin" / "compute-sanitizer"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\necho \"args: $*\"\necho '1 passed in 0.1s'\necho '========= ERROR SUMMARY: 0 errors'\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert gpu_kernels.find_compute_sanitizer() == str(tool)
    monkeypatch.delenv("CUDA_HOME")
    if not any(Path("/usr/local").glob("cuda*/bin/compute-sanitizer")):
        assert gpu_kernels.find_compute_sanitizer() is None
    result = gpu_kernels.run_memcheck(str(tool), quick=False)
    assert result["clean"] and result["sanitizer_errors"] == 0 and result["summary"] == "1 passed in 0.1s"
    assert result["command"].startswith(f"{tool} --tool memcheck --error-exitcode 1")
    assert result["command"].endswith(
        "tests/ops/test_triton.py tests/ops/test_triton_lora.py -q -p no:cacheprovider -m quick"
    )


@pytest.mark.parametrize("num_seqs, blocks_per_seq, expected", [(1, 128, 129), (8, 3, 25)])
def test_profile_caches_hold_block_zero_plus_every_table(num_seqs, blocks_per_seq, expected):
    assert gpu_e2e.profile_cache_blocks(num_seqs, blocks_per_seq) == expected


def test_runner_greedy_refuses_tables_past_the_cache():
    """The bug the 2047-token profile step had: 128 blocks for tables that reach block 128."""
    class Cache:
        shape = (128, 16, 1, 8)

    with pytest.raises(ValueError, match="need 129 cache blocks"):
        gpu_e2e.runner_greedy(None, [(Cache(), Cache())], [[7] * 2047], 1, 16, 128)
    Cache.shape = (129, 16, 1, 8)
    with pytest.raises(ValueError, match="2049 tokens do not fit 128 blocks of 16"):
        gpu_e2e.runner_greedy(None, [(Cache(), Cache())], [[7] * 2048], 2, 16, 128)


def test_pytest_starts_where_pydantic_does_not_import():
    """The GPU image runs pytest without pydantic: no configured warning filter may name it
    (older pytest releases refuse to start on a filter whose class does not import); the
    filter lives in tests/conftest.py, added only where pydantic imports."""
    import tomllib

    filters = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert filters and not [f for f in filters if "pydantic" in f]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/core/test_block_manager.py"],
        cwd=ROOT, env=hiding_env(Path(os.environ.get("TMPDIR", "/tmp")) / "gpu-check-hide-pytest", IMAGE_LACKS),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_a_terminated_run_keeps_its_report_and_removes_its_folders(tmp_path, carried_wheels):
    """What the machine's timeout does (SIGTERM) in the middle of a section: the report holds
    what finished, and the wheel folder is removed on the way out."""
    import signal

    folder = tmp_path / "wheels"
    folder.mkdir()
    for wheel in carried_wheels.glob("prometheus_client-*.whl"):
        (folder / wheel.name).symlink_to(wheel)
    out = tmp_path / "out"
    command = [sys.executable, "benchmarks/gpu_check.py", str(out), "--quick", "--cpu-backend", "torch", "--wheels",
               str(folder), "--only", "runner"]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, env=hiding_env(tmp_path / "hide", IMAGE_LACKS),
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    for line in process.stdout:
        if line.startswith("[gpu_check] runner ("):
            process.send_signal(signal.SIGTERM)
            break
    process.stdout.read()
    assert process.wait(timeout=120) == 128 + signal.SIGTERM
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["wheels"]["installed"][0].startswith("prometheus_client") and "runner" not in report
    assert not Path(report["wheels"]["target"]).exists()
