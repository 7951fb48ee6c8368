"""`bench report` draws each plot from the record its benchmark wrote, names the record's
commit and machine, and says which plots it skipped for want of a record."""

from __future__ import annotations

import json

from benchmarks import report
from benchmarks.records import write_record
from rayserve_paged import cli


def test_report_draws_the_plot_of_each_record_found_and_names_the_missing(tmp_path):
    records, images = tmp_path / "records", tmp_path / "images"
    assert cli.main(["bench", "memory", "--out", str(records), "--quick"]) == 0
    machine = json.loads((records / "memory.json").read_text())["machine"]
    assert machine["commit"] and machine["cpu_count"] >= 1  # every record says where it came from
    assert "commit " + machine["commit"] in report.provenance({"machine": machine})

    assert cli.main(["bench", "report", "--from", str(records), "--out", str(images)]) == 0
    made = report.report([str(records)], str(images))
    assert made["kv_memory.png"] == str(images / "kv_memory.png")
    assert (images / "kv_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for png, record in (("throughput.png", "throughput.json"), ("serving.png", "serving.json"),
                        ("smollm2.png", "quantized.json"), ("routing.png", "fleet_routing*")):  # fmt: skip
        assert made[png].startswith("skipped: no " + record) and not (images / png).exists()


def test_the_smollm2_plot_reads_the_figures_of_the_record_the_quantized_benchmark_writes(tmp_path):
    records, images = tmp_path / "records", tmp_path / "images"
    served = {key: {"startup_s": 30.0, "single": {"tokens_per_s": single}, "concurrent": {"tokens_per_s": many}}
              for key, single, many in (("serve_none", 13.5, 99.3), ("serve_auto", 11.8, 104.8))}  # fmt: skip
    write_record(str(records), "quantized", {"threads": 2, "num_requests": 32, **served})  # as quantized.main does

    assert report.smollm2_bars(json.loads((records / "quantized.json").read_text())) == [
        ("rayserve-paged, 4-bit", {"single": 11.8, "concurrent": 104.8}),
        ("rayserve-paged, float32", {"single": 13.5, "concurrent": 99.3}),
    ]  # llama-server was not run: no bar for it
    made = report.report([str(records)], str(images))
    assert made["smollm2.png"] == str(images / "smollm2.png")
    assert (images / "smollm2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
