"""`rayserve-paged bench attention-host` writes its figures and leaves the kernels in place
(never asserts speed)."""

from __future__ import annotations

import json

from rayserve_paged.cli import main
from rayserve_paged.ops import cache_ops, paged_attention


def test_attention_host_benchmark_writes_json_and_restores_the_stubs(tmp_path):
    from rayserve_paged.ops import triton_kernels

    kernel, write = triton_kernels.paged_decode_kernel, paged_attention.write_slots
    assert main(["bench", "attention-host", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "attention_host.json").read_text())["results"]
    assert set(result) == {"triton", "torch"}
    assert all(row["other_layers_us"] > 0 and row["step_us"] > 0 for row in result.values())
    assert triton_kernels.paged_decode_kernel is kernel and paged_attention.write_slots is write
    assert write is cache_ops.write_slots
