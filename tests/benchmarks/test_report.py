"""`bench report` draws each plot from the record its benchmark wrote, names the record's
commit and machine, and says which plots it skipped for want of a record."""

from __future__ import annotations

import json

from benchmarks import report
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
