"""Every Triton kernel variant the backend launches, compiled ahead of time for sm_80, sm_89
and sm_90 on this (GPU-less) machine: it compiles, its shared memory fits the target, fp16 /
bf16 attention kernels spill no registers, and K/V are read in 16-byte vectors.

The compiles run in fresh worker processes (triton_aot.compile_all), about 150 of them; the
set and why it is enough is in rayserve_paged/ops/triton_aot.py and docs/KERNELS.md.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")  # the only reason to skip: no compiler to check

from rayserve_paged.ops import triton_aot  # noqa: E402
from rayserve_paged.ops.triton_aot import TARGETS, ci_configs, problems  # noqa: E402

TARGET = {target.name: target for target in TARGETS}
# ~150 s of CPU on two idle cores (75-90 s wall); a loaded machine can take several times that
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return triton_aot.compile_all(None, TARGETS, jobs=2)


def _label(result: dict) -> str:
    return (
        f"{result['kernel']} {result['dtype']} head {result['head_dim']} group {result['group_size']} "
        f"block {result['block_size']} on {result['target']}"
    )


def test_every_variant_compiles_fits_and_does_not_spill(results):
    assert len(results) == sum(len(ci_configs(target)) for target in TARGETS)
    found = [f"{_label(result)}: {problem}" for result in results for problem in problems(result)]
    assert not found, "\n".join(found)


def test_sm89_builds_like_sm80_and_every_sm80_variant_fits_the_l40s(results):
    """sm_89 is sampled (head 128, fp16 / bf16, every kernel): it must use exactly the
    shared memory sm_80 uses, so sm_80's figures stand for it; and every sm_80 variant must
    fit the L40S's 99 KB too."""
    by_key = {}
    for result in results:
        key = tuple(
            result[k]
            for k in ("kernel", "dtype", "head_dim", "group_size", "block_size", "num_kv_heads", "sliding", "soft_cap")
        )
        by_key.setdefault(key, {})[result["target"]] = result
    sampled = [targets for targets in by_key.values() if "sm_89" in targets]
    assert len(sampled) == len(ci_configs(TARGET["sm_89"]))
    for targets in sampled:
        assert targets["sm_89"]["smem"] == targets["sm_80"]["smem"], _label(targets["sm_89"])
        assert targets["sm_89"]["spill_bytes"] == 0, _label(targets["sm_89"])
    too_big = [_label(r) for r in results if r["target"] == "sm_80" and r["smem"] > TARGET["sm_89"].smem_limit]
    assert not too_big, too_big


def test_the_compiled_set_covers_every_launchable_parameter():
    """Per kernel and target, every group size 1..8, block size, partition size and dtype is
    compiled at least once, and fp16 / bf16 attention at every head size."""
    from rayserve_paged.ops.triton_backend import PARTITION_SIZES

    for target in (TARGET["sm_80"], TARGET["sm_90"]):
        configs = ci_configs(target)
        for kernel in triton_aot.KERNELS:
            mine = [c for c in configs if c.kernel == kernel]
            assert {c.dtype for c in mine} == {"float16", "bfloat16", "float32"}
            if kernel == "group_quant_gemm":  # no KV blocks: its own parameters
                assert {(c.dtype, c.bits) for c in mine} == {
                    (d, b) for d in ("float16", "bfloat16", "float32") for b in triton_aot.QUANT_BITS
                }
                assert {c.group_size for c in mine} == set(triton_aot.QUANT_GROUP_SIZES)
                assert {c.num_rows for c in mine} == set(triton_aot.QUANT_ROWS)
                continue
            if kernel in triton_aot.LORA_KERNELS:  # every dtype, every rank width
                assert {c.lora_width for c in mine} == set(triton_aot.LORA_WIDTHS)
                continue
            assert {c.block_size for c in mine} == set(triton_aot.BLOCK_SIZES)
            if kernel in ("decode", "decode_partition", "prefill"):
                assert {c.group_size for c in mine} == set(triton_aot.GROUP_SIZES), kernel
                for dtype in ("float16", "bfloat16"):
                    assert {c.head_dim for c in mine if c.dtype == dtype} == set(triton_aot.HEAD_DIMS)
            if kernel in ("decode_partition", "decode_reduce"):
                assert {c.partition_size for c in mine} == set(PARTITION_SIZES), kernel
            if kernel == "reshape_and_cache":
                assert {c.num_kv_heads for c in mine} == set(triton_aot.KV_HEADS)
            if kernel in ("decode", "decode_partition", "prefill"):  # every (sliding, soft_cap) variant
                assert {(c.sliding, c.soft_cap) for c in mine} == {(False, False), *triton_aot.MASKINGS}, kernel
            if kernel == "decode_reduce":
                assert {c.sliding for c in mine} == {False, True}


def test_compile_problems_are_reported():
    """The checks themselves: a result over the limit, spilling or reading 4 bytes at a time fails."""
    good = dict(kernel="prefill", dtype="float16", smem=1000, smem_limit=2000, spill_bytes=0, widest_load_bits=128)
    assert problems(good) == []
    assert problems(good | {"smem": 3000}) == ["shared memory 3000 B > 2000 B"]
    assert problems(good | {"spill_bytes": 8}) == ["8 bytes of register spills"]
    assert problems(good | {"dtype": "float32", "spill_bytes": 8}) == []  # only fp16 / bf16 must not spill
    assert "16-byte vectors" in problems(good | {"widest_load_bits": 32})[0]
    assert problems(dict(good, error="CompilationError: x"))[0].startswith("does not compile")


def test_load_widths_are_read_from_ptx():
    ptx = """
    ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    @%p1 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
    cp.async.cg.shared.global [ %r335 + 0 ], [ %rd26 + 0 ], 0x10, %r62;
    cp.async.ca.shared.global [ %r359 + 0 ], [ %rd25 + 0 ], 0x4, %r61;
    """
    assert triton_aot.global_read_widths(ptx) == (128, 2)
