"""FP8 (e4m3) weights through the linear-method seam, on the CPU: the weights and scales load
and shard exactly (TP=1/2, fused pieces, row-parallel scales kept whole), the dequantized
reference equals the float32 layer of the same values, the FP8 GEMM (`torch._scaled_mm`, which
torch also serves on the CPU) is within FP8 rounding of it, and a tiny FP8 HF checkpoint
loads as its float32 twin. The FP8 GEMM serves by default only on CUDA sm_89+
(benchmarks/gpu_check.py times it there)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rayserve_paged.models.layers import ColumnParallelLinear, ParallelState, QKVParallelLinear, RowParallelLinear
from rayserve_paged.models.loader import load_model
from rayserve_paged.models.quant import FP8_DTYPE, Fp8LinearMethod, fp8_scaled_mm_supported, quantize_fp8
from rayserve_paged.models.tiny import make_tiny_model

from .test_hf_quant import LINEARS, SIZES, _logits

# The FP8 GEMM rounds each activation to e4m3 (3 mantissa bits: 2^-4 relative) against the
# float32 product of the same FP8 weights; 2^-3 of |x| @ |W|^T bounds it.
SCALED_MM_BOUND = 2**-3


def fp8_weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scales [out, 1], the float32 weight they dequantize to)."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    w8, scale = quantize_fp8(w)
    return w8, scale, w8.float() * scale


def load_fp8(layer, w8, scale, shard_id=None, use_scaled_mm=False, process=True):
    if not isinstance(layer.method, Fp8LinearMethod):
        layer.set_method(Fp8LinearMethod(use_scaled_mm))
    args = () if shard_id is None else (shard_id,)
    with torch.no_grad():
        layer.load_weight(layer.weight, w8, *args)
        layer.load_weight(layer.weight_scale, scale, *args)
        if process:
            layer.process_weights_after_loading()
    return layer


def test_quantize_fp8_round_trips_and_uses_the_range():
    w8, scale, weight = fp8_weight(48, 64, 0)
    assert w8.dtype == FP8_DTYPE and scale.shape == (48, 1) and scale.dtype == torch.float32
    assert torch.equal(w8.float().abs().amax(dim=1), torch.full((48,), 448.0))  # each row's largest is 448
    again, again_scale = quantize_fp8(weight)  # FP8 values times their scale quantize to themselves
    assert torch.equal(again.float(), w8.float()) and torch.allclose(again_scale, scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("use_scaled_mm", [False, True], ids=["dequantized", "scaled_mm"])
def test_layer_equals_the_float32_layer_of_its_values(use_scaled_mm):
    w8, scale, weight = fp8_weight(64, 128, 1)
    layer = load_fp8(ColumnParallelLinear(128, 64, bias=False), w8, scale, use_scaled_mm=use_scaled_mm)
    assert torch.equal(layer.method.dequantize(layer), weight)  # the reference is exact
    assert layer.weight.dtype == FP8_DTYPE and (layer.dense_weight is None) == use_scaled_mm
    for rows in (1, 5, 32):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (rows, 64)
        if use_scaled_mm:
            assert ((y - x @ weight.t()).abs() <= SCALED_MM_BOUND * (x.abs() @ weight.abs().t())).all()
        else:
            torch.testing.assert_close(y, x @ weight.t(), atol=1e-5, rtol=1e-5)


def test_tensor_parallel_shards_keep_their_rows_and_row_shards_keep_every_scale():
    w8, scale, weight = fp8_weight(64, 128, 2)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    columns, rows = [], []
    for rank in range(2):
        parallel = ParallelState(rank, 2)
        column = load_fp8(ColumnParallelLinear(128, 64, bias=False, parallel=parallel), w8, scale)
        assert torch.equal(column.method.dequantize(column), weight[rank * 32 : (rank + 1) * 32])
        columns.append(column(x))
        row = load_fp8(RowParallelLinear(128, 64, bias=False, parallel=parallel), w8, scale)
        assert torch.equal(row.weight_scale, scale)  # one scale per output feature: whole on every rank
        assert torch.equal(row.method.dequantize(row), weight[:, rank * 64 : (rank + 1) * 64])
        rows.append(row.matmul(x[:, rank * 64 : (rank + 1) * 64]))
    want = x @ weight.t()
    torch.testing.assert_close(torch.cat(columns, dim=-1), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows[0] + rows[1], want, atol=1e-5, rtol=1e-5)


def test_fused_qkv_pieces_with_their_own_scales():
    pieces = {"q": fp8_weight(64, 64, 3), "k": fp8_weight(32, 64, 4), "v": fp8_weight(32, 64, 5)}
    layer = QKVParallelLinear(64, 16, 4, 2, bias=False)
    for shard_id, (w8, scale, _) in pieces.items():
        load_fp8(layer, w8, scale, shard_id, process=False)
    layer.process_weights_after_loading()
    assert torch.equal(layer.method.dequantize(layer), torch.cat([w for _, _, w in pieces.values()]))


def test_the_fp8_gemm_serves_only_cuda_sm89_and_up():
    assert not fp8_scaled_mm_supported(torch.device("cpu"))


def write_fp8(base_dir, out_dir, per_tensor: set[str]):
    """(FP8 checkpoint dir, float32 twin dir): every linear weight of base_dir's tiny Llama in
    e4m3 with per-channel scales ([out]; one per-tensor scale for the projections named in
    `per_tensor`) and a static input scale (which the loader drops)."""
    config = json.loads((base_dir / "config.json").read_text())
    quantized, twin = {}, {}
    for name, tensor in load_file(str(base_dir / "model.safetensors")).items():
        prefix = name.removesuffix(".weight")
        linear = next((lin for lin in LINEARS if prefix.endswith(lin)), None)
        if linear is None:
            quantized[name] = twin[name] = tensor
            continue
        if linear in per_tensor:
            scale = (tensor.abs().amax() / 448).reshape(())
            w8 = (tensor / scale).to(FP8_DTYPE)
            twin[name] = w8.float() * scale
        else:
            w8, scale = quantize_fp8(tensor)
            twin[name], scale = w8.float() * scale, scale.reshape(-1)
        quantized[name], quantized[f"{prefix}.weight_scale"] = w8, scale
        quantized[f"{prefix}.input_scale"] = torch.tensor(0.01)
    dirs = []
    for kind, weights in (("quantized", quantized), ("twin", twin)):
        path = out_dir / kind
        path.mkdir()
        cfg = config | ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
                        if kind == "quantized" else {})  # fmt: skip
        (path / "config.json").write_text(json.dumps(cfg))
        (path / "generation_config.json").write_text((base_dir / "generation_config.json").read_text())
        save_file(weights, str(path / "model.safetensors"))
        dirs.append(path)
    return dirs


def test_fp8_checkpoint_loads_as_its_float_twin(tmp_path):
    base_dir = make_tiny_model("llama", tmp_path / "base", **SIZES)
    quantized_dir, twin_dir = write_fp8(base_dir, tmp_path, per_tensor={"self_attn.k_proj", "mlp.down_proj"})
    ours, twin = load_model(quantized_dir, dtype=torch.float32), load_model(twin_dir, dtype=torch.float32)
    twin_modules = dict(twin.named_modules())
    kept = [name for name, m in ours.named_modules() if isinstance(getattr(m, "method", None), Fp8LinearMethod)]
    assert len(kept) == 2 * 4  # qkv, o, gate_up, down per layer; embedding and LM head stay float
    for name in kept:
        module = dict(ours.named_modules())[name]
        assert module.weight.dtype == FP8_DTYPE
        assert torch.equal(module.method.dequantize(module), twin_modules[name].weight), name
    for got, want in zip(_logits(quantized_dir), _logits(twin_dir), strict=True):  # on the CPU: dequantized at load
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="quantization 'awq' was asked for, but .* is fp8"):
        load_model(quantized_dir, quantization="awq")
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (quantized_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"block-wise scales \(weight_block_size\) are not supported"):
        load_model(quantized_dir)
