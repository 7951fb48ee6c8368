"""benchmarks/gpu_check.py's CPU part, as the GPU image runs it: no ray; pydantic and the
OpenTelemetry SDK either present or brought along as wheels. (The measurement code's own
tests are in tests/ops/test_triton.py, which gpu_check runs compiled on the GPU.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_e2e, gpu_kernels

ROOT = Path(__file__).resolve().parents[2]


def run_gpu_check(out: Path, *, blocked: tuple[str, ...], extra: tuple[str, ...] = ()) -> dict:
    """gpu_check's CPU part in a fresh interpreter with `blocked` modules unimportable and
    no CUDA device visible; its JSON report."""
    code = (
        f"import sys\nfor name in {list(blocked)!r}: sys.modules[name] = None\n"
        "import runpy\n"
        f"sys.argv = ['gpu_check', {str(out)!r}, '--quick', '--skip-tests', '--cpu-backend', 'torch', *{list(extra)!r}]\n"
        "runpy.run_path('benchmarks/gpu_check.py', run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
    }
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


def assert_runner_passed(runner: dict) -> None:
    assert runner["failures"] == [] and runner["hf_parity_float32"] == {"prompts": 4, "exact": 4}
    assert runner["swap_roundtrip_equal"] == {"float32": True} and runner["backend"] == "torch"
    # the static-shape decode path ran (padded, eagerly: no CUDA here) and gave the eager tokens
    assert runner["static_decode_equal"] == {"float32": True} and runner["static_decode_graphs"] == {"float32": []}
    assert runner["static_decode_runs"]["float32"]["eager"] > 0 == runner["static_decode_runs"]["float32"]["graph"]


def test_cpu_part_runs_the_engine_path_without_ray(tmp_path):
    """The runner check and the engine step: LLM -> LLMEngine -> InProcessExecutor -> Worker,
    with the static decode path on and off (enforce_eager) and the interpreted triton
    kernels, each giving HF's float32 greedy tokens."""
    report = run_gpu_check(tmp_path, blocked=("ray",))
    assert_runner_passed(report["runner"])
    assert report["errors"] == {} and "e2e" not in report["skipped"]
    assert report["wheels"] == {"missing_before": [], "installed": [], "missing": []}
    e2e = report["e2e"]
    assert e2e["failures"] == [] and e2e["device"] == "cpu"
    labels = ("torch", "torch:eager", "triton")
    for label in labels:
        assert e2e[f"hf_parity_{label}"]["exact_match_rate"] == 1.0
        path = e2e[f"engine_path_{label}"]
        assert (path["engine"], path["executor"], path["worker"], path["device"]) == (
            "LLMEngine", "InProcessExecutor", "Worker", "cpu"
        )
        assert path["cuda_graphs"] == [] and path["num_gpu_blocks"] > 0
    assert e2e["engine_path_torch:eager"]["static_decode_runs"] is None
    for label in ("torch", "triton"):
        assert e2e[f"engine_path_{label}"]["static_decode_runs"]["eager"] > 0
    assert report["step_seconds"]["runner"]["budget"] == 75
    assert report["skipped"]["memcheck"] == "--skip-tests"


def test_cpu_part_without_pydantic_or_wheels_skips_only_the_engine_step(tmp_path):
    report = run_gpu_check(tmp_path / "out", blocked=("ray", "pydantic"), extra=("--wheels", str(tmp_path / "none")))
    assert_runner_passed(report["runner"])
    assert report["wheels"]["missing"] == ["pydantic"] and report["wheels"]["installed"] == []
    reason = report["skipped"]["e2e"]
    assert "pydantic" in reason and "gpu_check_wheels.txt" in reason and report["errors"] == {}


def make_wheel(folder: Path, module: str, version: str = "1.0") -> Path:
    """A pure-Python wheel holding one module that defines VALUE = 42."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": "VALUE = 42\n",
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
