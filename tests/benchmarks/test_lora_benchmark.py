"""The LoRA benchmark: registered, its adapter writer gives what the engine loads, and a
quick run reports every case (figures live in docs/BENCHMARKS.md, never in tests)."""

from __future__ import annotations

import json

from benchmarks import lora
from rayserve_paged import cli
from rayserve_paged.models.loader import load_model
from rayserve_paged.models.lora import read_peft_adapter, shard_adapter
from rayserve_paged.models.tiny import make_tiny_model


def test_registered_as_a_bench_command():
    assert cli.BENCHMARKS["lora"] == "benchmarks.lora"


def test_the_random_adapter_is_a_peft_directory_for_every_target(tmp_path):
    model_dir = make_tiny_model("opt", tmp_path / "opt")
    path = lora.write_random_adapter(model_dir, tmp_path / "a", 4, 8, lora.OPT_TARGETS, seed=0)
    adapter = read_peft_adapter(path, 4)
    assert (adapter.rank, adapter.scaling) == (4, 2.0)
    assert len(adapter.tensors) == 2 * len(lora.OPT_TARGETS)  # two layers
    assert adapter.tensors["model.decoder.layers.1.fc1"][1].shape == (256, 4)
    shards = shard_adapter(load_model(model_dir), adapter, 4)
    assert sorted(n.rpartition(".")[2] for n in shards) == sorted(["qkv_proj", "out_proj", "fc1", "fc2"] * 2)


def test_quick_run_reports_every_case(tmp_path, capsys):
    assert lora.main(["--quick", "--out", str(tmp_path), "--repeats", "1"]) == 0
    result = json.loads((tmp_path / "lora.json").read_text())
    assert sorted(result["cases"]) == ["0", "1", "2"]
    assert result["ratio_to_base"]["0"] == 1.0 and result["target_met"] is None
    assert (result["slot_loads"], result["slot_evictions"]) == (2, 0)  # both fit: loaded once
    assert all(c["output_tokens_per_s"] > 0 for c in result["cases"].values())
    assert len(result["load"]["read_and_shard_ms"]) == 2
    gap, decode = result["load_gap"]["after"], result["base_decode"]["after"]
    assert gap["output_tokens"] == lora.GAP_QUICK["output_len"] and gap["num_gaps_during_load"] >= 1
    assert decode["lora_on"]["output_tokens_per_s"] > 0 and decode["lora_off"]["output_tokens_per_s"] > 0
    out = capsys.readouterr().out
    assert "adapter load" in out and "load gap (after)" in out and "base decode (after" in out
