"""The quantized-weights benchmark's pieces that need no model: registration, agreement."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import quantized
from rayserve_paged import cli


def test_registered_as_a_bench_command():
    assert cli.BENCHMARKS["quantized"] == "benchmarks.quantized"


def test_agreement_counts_identical_sequences_and_tokens_before_the_first_difference():
    want = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]]
    result = quantized.agreement(got, want)
    assert result["num_identical"] == 1 and result["num_sequences"] == 3
    assert result["agreeing_prefix_tokens"] == [4, 2, 0]
    assert result["mean_agreeing_prefix"] == 2.0
    assert result["tokens_before_first_difference_share"] == 6 / 10


def _fake_engine(quantization, *args, source=None, **kwargs):
    result = {"quantization": quantization, "load_model_s": 1.0, "llm_construct_s": 1.0, "peak_rss_gib": 1.0,
              "single": {"tokens_per_s": 1.0}, "concurrent": {"tokens_per_s": 2.0},
              "token_ids": [[3, 3]] if source else [[1, 2]]}  # fmt: skip
    return result | {"version": "before"} if source else result


def _args(tmp_path, llama_server: str | None, before: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(threads=1, num_requests=1, max_tokens=2, rounds=1, no_kernels=True, no_http=True,
                              llama_server=llama_server, out=str(tmp_path), before=before, layouts=[])  # fmt: skip


def test_an_earlier_version_runs_first_in_each_round_and_stays_out_of_the_agreement(tmp_path, monkeypatch):
    monkeypatch.setattr(quantized, "_engine_in_subprocess", _fake_engine)
    result = quantized.run(_args(tmp_path, None, before=str(tmp_path)), log=lambda message: None)
    assert [(e.get("version"), e["quantization"]) for e in result["engine"]] == [
        ("before", "none"), ("before", "auto"), (None, "none"), (None, "auto")]
    assert all("token_ids" not in e for e in result["engine"])
    assert result["agreement"]["num_identical"] == 1  # now's auto against now's none
    assert "before quantization none" in quantized.format_report(result)


def test_layouts_are_replicas_by_threads():
    assert quantized._layouts("1x2,2x1") == [(1, 2), (2, 1)]
    for bad in ("1x", "2x0", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="REPLICASxTHREADS"):
            quantized._layouts(bad)


def test_llama_server_is_skipped_when_its_path_is_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(quantized, "_engine_in_subprocess", _fake_engine)
    result = quantized.run(_args(tmp_path, str(tmp_path / "missing")), log=lambda message: None)
    assert result["llama_server"] == {"skipped": f"{tmp_path / 'missing'} does not exist"}
    assert result["agreement"]["num_identical"] == 1
    assert "llama_server: skipped" in quantized.format_report(result)


def test_a_llama_server_that_dies_is_recorded_not_raised(tmp_path, monkeypatch):
    def dies(*args, **kwargs):
        raise RuntimeError("llama-server exited with -4")

    monkeypatch.setattr(quantized, "_engine_in_subprocess", _fake_engine)
    monkeypatch.setattr(quantized, "run_llama_server", dies)
    binary = tmp_path / "llama-server"
    binary.write_text("")
    result = quantized.run(_args(tmp_path, str(binary)), log=lambda message: None)
    assert result["llama_server"] == {"failed": "llama-server exited with -4"}
    assert "llama_server: failed (llama-server exited with -4)" in quantized.format_report(result)
