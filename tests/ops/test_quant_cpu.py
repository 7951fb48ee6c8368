"""The compiled CPU group-quantized GEMM (ops/quant_cpu.py) against x @ W^T of its dequantized
float32 weight: the AVX-512 build this machine makes and the portable one (-mno-avx512f), row
counts across the 8-row tiles, 4- and 8-bit codes, group sizes 32-128, output rows that are
not a multiple of the 16-row blocks; the layout round-trips exactly."""

from __future__ import annotations

import pytest
import torch

from rayserve_paged.ops import cpu_decode, quant_cpu

from .builders import group_quantized as quantized

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason="needs a C++ compiler")

BUILDS = {"native": (), "portable": ("-mno-avx512f",)}


@pytest.mark.parametrize("out_features, in_features, bits, group_size", [(96, 128, 4, 32), (40, 256, 4, 128),
                                                                         (80, 192, 8, 64), (7, 64, 8, 32)])  # fmt: skip
def test_layout_round_trips_exactly(out_features, in_features, bits, group_size):
    codes, scales, offsets, _ = quantized(out_features, in_features, bits, group_size, 0)
    packed = quant_cpu.pack(codes, scales, offsets, bits)
    padded = -(-out_features // 16) * 16
    assert packed.codes.shape == (padded // 16, in_features * bits // 8, 16)
    assert packed.scales.shape == packed.offsets.shape == (padded // 16, in_features // group_size, 16)
    got = packed.unpack()
    assert torch.equal(got[0], codes) and torch.equal(got[1], scales) and torch.equal(got[2], offsets)
    ids = torch.tensor([out_features - 1, 0, out_features // 2, 0])
    rows = packed.rows(ids)
    assert torch.equal(rows[0], codes[ids]) and torch.equal(rows[1], scales[ids]) and torch.equal(rows[2], offsets[ids])


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("out_features, in_features, bits, group_size", [(96, 128, 4, 32), (40, 256, 4, 128),
                                                                         (80, 192, 8, 64), (7, 64, 8, 32)])  # fmt: skip
def test_kernel_equals_the_dequantized_float32_product(out_features, in_features, bits, group_size, build):
    kernel = quant_cpu.load(BUILDS[build])
    assert kernel is not None
    codes, scales, offsets, weight = quantized(out_features, in_features, bits, group_size, 1)
    packed = quant_cpu.pack(codes, scales, offsets, bits)
    for rows in (1, 2, 7, 8, 9, 17, 33):  # whole 8-row tiles and every remainder kind
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        y = kernel(x, packed)
        assert y.dtype == torch.float32 and y.shape == (rows, out_features)
        # float32 throughout: the float32 product up to summation order
        bound = 2**-16 * (x.abs() @ weight.abs().t()) + 1e-6
        assert ((y - x @ weight.t()).abs() <= bound).all()
    assert kernel(torch.zeros(0, in_features), packed).shape == (0, out_features)


def test_threads_split_output_blocks_with_the_same_sums():
    kernel = quant_cpu.load()
    codes, scales, offsets, _ = quantized(96, 128, 4, 32, 2)
    packed = quant_cpu.pack(codes, scales, offsets, 4)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    num_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, packed)
        torch.set_num_threads(2)
        two = kernel(x, packed)
    finally:
        torch.set_num_threads(num_threads)
    assert torch.equal(one, two)  # a block's sums never depend on the thread that computes it


def test_bad_inputs_are_refused_by_name():
    kernel = quant_cpu.load()
    codes, scales, offsets, _ = quantized(32, 64, 4, 32, 0)
    packed = quant_cpu.pack(codes, scales, offsets, 4)
    with pytest.raises(ValueError, match=r"x \(2, 96\) on cpu does not fit a weight \[32, 64\]"):
        kernel(torch.zeros(2, 96), packed)
    with pytest.raises(ValueError, match="4- or 8-bit codes, not 3"):
        quant_cpu.pack(codes, scales, offsets, 3)
    three_groups = packed.scales[:, :1].expand(-1, 3, -1).contiguous()  # 64 features in groups of 21
    with pytest.raises(ValueError, match="the kernel refused K=64, group size 21, 4 bits"):
        kernel(torch.zeros(1, 64), quant_cpu.PackedGroupQuant(packed.codes, three_groups, packed.offsets, 32, 64, 4))
