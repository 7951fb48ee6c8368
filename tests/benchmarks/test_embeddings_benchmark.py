"""`rayserve-paged bench embeddings --quick` writes its figures (never asserts speed)."""

from __future__ import annotations

import json

from rayserve_paged.cli import main


def test_embeddings_benchmark_writes_its_rows(tmp_path):
    assert main(["bench", "embeddings", "--quick", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "embeddings.json").read_text())
    assert set(record["results"]) == {
        "engine_embed", "hf_automodel_batch32", "prefill_1_token", "prefill_1_token_prompt_logprobs",
    }  # fmt: skip
    for row in record["results"].values():
        assert row["seconds"] > 0 and row["inputs_per_s"] > 0
    assert record["machine"]["cpu_count"] >= 1
