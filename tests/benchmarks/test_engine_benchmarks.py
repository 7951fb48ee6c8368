"""Behaviour of the engine benchmarks (KV sharing, throughput) on quick runs, never their speed."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import sharing
from rayserve_paged import cli

DATASETS = ("sharegpt", "alpaca")
CASES = ("parallel_n2", "parallel_n4", "parallel_n6", "beam_w2", "beam_w4", "beam_w6")


@pytest.fixture(scope="module")
def sharing_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-sharing")
    assert cli.main(["bench", "sharing", "--out", str(out), "--quick", "--seed", "0"]) == 0
    return json.loads((out / "sharing.json").read_text())


@pytest.fixture(scope="module")
def throughput_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-throughput")
    assert cli.main(["bench", "throughput", "--out", str(out), "--quick", "--threads", "1"]) == 0
    return json.loads((out / "throughput.json").read_text())


def test_both_are_registered():
    assert cli.BENCHMARKS["sharing"] == "benchmarks.sharing"
    assert cli.BENCHMARKS["throughput"] == "benchmarks.throughput"


# ---------------------------------------------------------------------------- sharing


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("case", CASES)
def test_sharing_json_has_sane_saved_fraction(sharing_json, dataset, case):
    figures = sharing_json[dataset][case]
    assert 0 <= figures["saved_fraction"] < 1
    assert figures["block_steps_with_sharing"] <= figures["block_steps_without_sharing"]
    assert figures["peak_blocks_with_sharing"] <= figures["peak_blocks_without_sharing"]
    assert figures["num_steps"] > 0


def test_sharing_json_records_config_and_seed(sharing_json):
    assert sharing_json["seed"] == 0
    assert sharing_json["quick"] is True
    engine = sharing_json["config"]["engine"]
    assert engine["block_size"] == 16
    assert engine["enable_prefix_caching"] is False
    assert engine["enable_chunked_prefill"] is False  # one prefill step per prompt, as the checks assume


def test_the_quick_run_batches_prompts_beyond_one_budget(sharing_json):
    """The quick run's ShareGPT prompts together exceed one step's token budget, so several
    prefill steps share the batch with decodes: the schedule a full run has, where a check
    that assumes one request per prefill step would fail."""
    workload = sharing_json["sharegpt"]["workload"]
    assert workload["num_requests"] * workload["mean_prompt_len"] > 2048


def test_sharing_beam_saves_more_than_parallel_n2_on_sharegpt(sharing_json):
    d = sharing_json["sharegpt"]
    assert d["beam_w2"]["saved_fraction"] > d["parallel_n2"]["saved_fraction"]


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("kind", ("parallel", "beam"))
def test_sharing_grows_with_width(sharing_json, dataset, kind):
    d = sharing_json[dataset]
    saved = [d[f"{kind}_{'n' if kind == 'parallel' else 'w'}{w}"]["saved_fraction"] for w in (2, 4, 6)]
    assert saved[0] < saved[1] < saved[2]


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("n", (2, 4, 6))
def test_parallel_sampling_matches_the_length_only_expectation(sharing_json, dataset, n):
    figures = sharing_json[dataset][f"parallel_n{n}"]
    assert math.isclose(figures["saved_fraction"], figures["expected_saved_fraction"], rel_tol=1e-12)


def test_sharing_run_was_consistent(sharing_json):
    assert sharing_json["consistency_problems"] == []
    for dataset in DATASETS:
        for case in CASES:
            figures = sharing_json[dataset][case]
            assert figures["num_preemptions"] == 0
            assert figures["gpu_blocks_used_after"] == 0
            assert figures["unaccounted_block_steps"] == 0


def test_expected_parallel_saving_by_hand():
    # P = 20 (1 full + 1 partial block), O = 3, n = 2, block size 16:
    #   step 1: 2 blocks (prompt, alone); steps 2-3: lengths 21, 22 -> 2 blocks each per sample,
    #   1 shared -> with sharing 1 + 2 * 1 = 3, without 2 * 2 = 4
    requests = [sharing.Request(0, 20, 3)]
    expected = 1 - (2 + 3 + 3) / (2 + 4 + 4)
    assert math.isclose(sharing.expected_parallel_saving(requests, 2, 16), expected)


# ---------------------------------------------------------------------------- throughput


def test_throughput_json_has_sane_values(throughput_json):
    assert throughput_json["engine_output_tokens_per_s"] > 0
    assert throughput_json["hf_output_tokens_per_s"] > 0
    assert throughput_json["ratio"] > 0
    assert math.isclose(
        throughput_json["ratio"],
        throughput_json["engine_output_tokens_per_s"] / throughput_json["hf_output_tokens_per_s"],
    )
    assert throughput_json["hf_batch_size"] >= 1
    assert throughput_json["engine_preemptions"] == 0


def test_throughput_json_records_config(throughput_json):
    cfg = throughput_json["config"]
    assert cfg["torch_threads"] == 1
    assert cfg["engine"]["num_cpu_threads"] == 1
    w = cfg["workload"]
    num_output_tokens = cfg["num_output_tokens"]
    assert w["num_requests"] * w["min_output_len"] <= num_output_tokens <= w["num_requests"] * w["max_output_len"]
    assert cfg["model"]["dtype"] == "float32"
    assert throughput_json["quick"] is True


# ---------------------------------------------------------------------------- mixed load


def test_mixed_load_runs_chunked_and_unchunked_over_the_same_requests(tmp_path):
    assert cli.BENCHMARKS["mixed"] == "benchmarks.mixed_load"
    assert cli.main(["bench", "mixed", "--out", str(tmp_path), "--quick"]) == 0
    result = json.loads((tmp_path / "mixed.json").read_text())
    chunked, whole = result["runs"]
    assert (chunked["chunked_prefill"], whole["chunked_prefill"]) == (True, False)
    assert chunked["max_num_batched_tokens"] == 32 and whole["max_num_batched_tokens"] == 2048
    # 2 decodes x 6 tokens + 1 long prompt x 8 tokens, in both runs
    assert chunked["output_tokens"] == whole["output_tokens"] == 2 * 6 + 8
    for run in (chunked, whole):
        for name in ("ttft_s", "tpot_s", "itl_s"):
            assert 0 < run[name]["p50"] <= run[name]["p99"]
