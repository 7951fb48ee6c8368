"""The group-quantized GEMM kernel against x @ W^T of its dequantized weight, on random inputs
(CPU: under the Triton interpreter, set before the kernel module is imported)."""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("RAYSERVE_PAGED_TRITON_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from rayserve_paged.ops import quant_gemm  # noqa: E402

from .builders import group_quantized as quantized  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, out_features, in_features, bits, group_size",
    [(1, 96, 128, 4, 32), (5, 64, 256, 4, 128), (17, 80, 192, 8, 64), (3, 128, 128, 8, 32)],
)
def test_kernel_equals_the_dequantized_product(rows, out_features, in_features, bits, group_size, dtype):
    codes, scales, offsets, weight = quantized(out_features, in_features, bits, group_size, rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7)).to(dtype)
    packed = quant_gemm.pack_codes(codes, bits)
    assert packed.shape == (out_features, in_features * bits // 8)
    args = [t.to(DEVICE) for t in (x, packed, scales, offsets)]
    y = quant_gemm.group_quant_matmul(*args, bits, group_size).cpu()
    assert y.dtype == dtype and y.shape == (rows, out_features)
    want = x.float() @ weight.t()
    # float32: exact up to summation order; 16-bit types: operands rounded to 8 / 11 bits
    bound = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}[dtype]
    assert ((y.float() - want).abs() <= bound * (x.float().abs() @ weight.abs().t()) + 1e-6).all()


def test_bad_shapes_are_refused_before_launch():
    codes, scales, offsets, _ = quantized(64, 128, 4, 32, 0)
    with pytest.raises(ValueError, match=r"x \[2, 96\] does not fit scales \[64, 4\] in groups of 32"):
        quant_gemm.group_quant_matmul(torch.zeros(2, 96), quant_gemm.pack_codes(codes, 4), scales, offsets, 4, 32)
    with pytest.raises(ValueError, match="3-bit codes"):
        quant_gemm.gemm_constants(torch.float16, 3, 32, 1, interpreted=True)


@pytest.mark.parametrize("bits, group_size, tp_rank", [(4, 32, 0), (8, 64, 1)])
def test_linear_layer_on_the_triton_plan(bits, group_size, tp_rank):
    """models/quant.py's CUDA plan (run here on CPU tensors through the interpreter): a
    row-parallel shard keeps its codes packed, dequantizes exactly, and multiplies right."""
    from rayserve_paged.models.layers import ParallelState, RowParallelLinear
    from rayserve_paged.models.quant import QUANT_PARAM_NAMES, KernelPlan, GroupQuantFormat, GroupQuantLinearMethod

    codes, scales, offsets, weight = quantized(64, 256, bits, group_size, 3)
    plan = KernelPlan(False, torch.float32, 0, "test: triton", is_triton=True)
    layer = RowParallelLinear(256, 64, bias=False, parallel=ParallelState(tp_rank, 2))
    layer.set_method(GroupQuantLinearMethod(GroupQuantFormat("test", bits, group_size), plan))
    with torch.no_grad():
        for name, full in zip(QUANT_PARAM_NAMES, (codes, scales, offsets)):
            layer.load_weight(getattr(layer, name), full)
        layer.process_weights_after_loading()
    shard = weight[:, tp_rank * 128 : (tp_rank + 1) * 128]
    assert layer.weight_codes.numel() == 0 and layer.packed_codes.shape == (64, 128 * bits // 8)
    assert torch.equal(layer.method.dequantize(layer), shard)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(layer.matmul(x), x @ shard.t(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("num_sms", [1, 6, 132])
@pytest.mark.parametrize("rows", [1, 16])
def test_decode_tile_split_over_k_equals_the_reference(monkeypatch, rows, num_sms):
    """The decode tile (BLOCK_K = the group, float32 partials per K split, summed) at 1, a
    few and many splits: each equal to the dequantized product."""
    monkeypatch.setattr(quant_gemm, "_num_sms", lambda device: num_sms)
    codes, scales, offsets, weight = quantized(64, 512, 4, 128, 11)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3))
    constants = quant_gemm.gemm_constants(torch.float32, 4, 128, rows, interpreted=True)
    assert quant_gemm.split_k(rows, 64, 512, constants, num_sms) == {1: (1, 512), 6: (3, 192), 132: (8, 64)}[num_sms]
    args = [t.to(DEVICE) for t in (x, quant_gemm.pack_codes(codes, 4), scales, offsets)]
    y = quant_gemm.group_quant_matmul(*args, 4, 128).cpu()
    assert ((y - x @ weight.t()).abs() <= 1e-5 * (x.abs() @ weight.abs().t()) + 1e-6).all()


def test_decode_tile_fills_the_sms_and_compiles_once_for_every_row_count():
    """On an H100 / H200 (132 SMs), a 4096 x 4096 layer at 1..16 rows runs at least one
    program per SM (the 64-wide tile ran 64); the row count is never specialized on; float32
    operands multiply in IEEE float32, not TF32."""
    for rows in (1, 7, 16):
        constants = quant_gemm.gemm_constants(torch.bfloat16, 4, 128, rows, interpreted=False)
        assert (constants["BLOCK_M"], constants["BLOCK_N"], constants["BLOCK_K"]) == (16, 32, 128)
        splits, k_per_split = quant_gemm.split_k(rows, 4096, 4096, constants, 132)
        assert (4096 // 32) * splits >= 132 and k_per_split % 128 == 0 and splits * k_per_split == 4096
    assert quant_gemm.gemm_constants(torch.float16, 8, 64, 1, interpreted=False)["BLOCK_K"] == 64
    assert quant_gemm.split_k(17, 4096, 4096, quant_gemm.gemm_constants(torch.float16, 4, 128, 17, interpreted=False),
                              132) == (1, 4096)  # fmt: skip
    from rayserve_paged.ops.triton_aot import not_specialized_arguments

    assert "num_rows" in not_specialized_arguments(quant_gemm.group_quant_gemm_kernel)
    for interpreted in (False, True):
        assert quant_gemm.gemm_constants(torch.float32, 4, 32, 1, interpreted=interpreted)["DOT_PRECISION"] == "ieee"
