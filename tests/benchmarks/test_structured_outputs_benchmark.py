"""`rayserve-paged bench structured-outputs` writes its figures (never asserts speed)."""

from __future__ import annotations

import json

from rayserve_paged.cli import main


def test_structured_outputs_benchmark_writes_mask_and_compile_figures(tmp_path):
    argv = ["bench", "structured-outputs", "--mask-steps", "3", "--hostile-steps", "1", "--models", "tiny-opt",
            "--skip-batch"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "structured_outputs.json").read_text())["results"]
    assert set(results["mask"]["tiny-opt"]) == {"1", "16", "64"}
    for row in results["mask"]["tiny-opt"].values():
        assert row["build"] > 0 and row["apply"] > 0 and row["total"] >= row["build"] + row["apply"]
    assert results["compile"]["tiny-opt"]["cold_ms"] > results["compile"]["tiny-opt"]["cached_ms"]
    assert results["batch"] == []
    hostile = results["hostile"]["tiny-opt"]
    assert set(hostile["compile"]) == {"required-recursion", "string-or-recursion", "lark-a-start", "gbnf-x-root",
                                       "nested-repeats", "huge-repeat", "benign-schema"}  # fmt: skip
    refused = {name for name, row in hostile["compile"].items() if "refused" in row}
    assert refused == {"required-recursion", "lark-a-start", "gbnf-x-root", "huge-repeat"}
    assert set(hostile["masked"]) == {"string-or-recursion", "nested-repeats"} and set(hostile["mask"]) == {"16", "64"}
