"""HF int4 checkpoints (AWQ and GPTQ) in the GroupQuant form of quant.py, and FP8 checkpoints.

Both store, per linear layer `<prefix>`, int32 words of eight 4-bit values:

    GPTQ  <prefix>.qweight [in / 8, out]   eight input features per word, low nibble first
          <prefix>.qzeros  [in / g, out / 8] eight output features per word
          <prefix>.scales  [in / g, out]   float16
          <prefix>.g_idx   [in]            group of each input feature (only k // g is run)
          W[n, k] = scale[k // g, n] * (q[k, n] - z[k // g, n])
          with z = stored zero + 1 in AutoGPTQ's original format (`checkpoint_format: gptq`,
          the default), z = stored zero for `gptq_v2`.
    AWQ   <prefix>.qweight [in, out / 8]   eight output features per word, in the order
          <prefix>.qzeros  [in / g, out / 8]   0 2 4 6 1 3 5 7 (word nibble i holds feature
          <prefix>.scales  [in / g, out]       8j + AWQ_ORDER[i])
          W[n, k] = scale[k // g, n] * (q[k, n] - z[k // g, n])

The conversion gives codes q, scales s and offsets -s * z in float32, which dequantize to
s * (q - z) exactly (an float16 scale times an integer below 17 is exact in float32).
`quantization_config` in config.json, or an older checkpoint's quantize_config.json, names
the method, bits and group size.

    FP8   <prefix>.weight       [out, in]  float8_e4m3fn        (`quant_method: fp8`)
          <prefix>.weight_scale []  or [out] / [out, 1] float32
          <prefix>.input_scale  (static activation scales: read and not used; the FP8 GEMM
                                 takes a dynamic scale per call)
          W[n, k] = weight_scale[n] * weight[n, k]; a per-tensor scale becomes one per feature.
          Block-wise scales (`weight_block_size`) are refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from .quant import FP8_DTYPE, Fp8Format, GroupQuantFormat, QuantizedTensor

HF_METHODS = ("awq", "gptq", "fp8")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output feature 8j + AWQ_ORDER[i]
_PARTS = ("qweight", "qzeros", "scales")


def with_quantize_config(hf_config: dict, path: Path) -> dict:
    """config.json's dict, with an older GPTQ checkpoint's quantize_config.json folded in."""
    file = path / "quantize_config.json"
    if "quantization_config" in hf_config or not file.is_file():
        return hf_config
    extra = json.loads(file.read_text(encoding="utf-8"))
    return {**hf_config, "quantization_config": {"quant_method": "gptq", **extra}}


def quantization_method(hf_config: dict) -> str | None:
    """"awq" / "gptq" for a checkpoint this loader keeps quantized; None for float ones."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in HF_METHODS:
        raise ValueError(f"unsupported quantization_config.quant_method {method!r}; supported: {', '.join(HF_METHODS)}")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError("FP8 checkpoints with block-wise scales (weight_block_size) are not supported")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 checkpoints in {qc['fmt']!r}: only e4m3 is supported")
        return method
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoint with {bits}-bit weights: only 4-bit is supported")
    if method == "gptq" and qc.get("desc_act"):
        raise ValueError("GPTQ checkpoints with desc_act (act-order) are not supported")
    if method == "awq" and (qc.get("version", "gemm").lower() != "gemm" or qc.get("zero_point") is False):
        raise ValueError("only AWQ GEMM checkpoints with zero points are supported")
    group_size(hf_config)
    return method


def group_size(hf_config: dict) -> int:
    qc = hf_config["quantization_config"]
    size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"quantization_config.group_size {size!r}: a positive group size is needed (-1 is not supported)")
    return size


def hf_weight_formats(hf_config: dict, tensor_names: Iterable[str]) -> dict[str, GroupQuantFormat | Fp8Format]:
    """HF weight name (`<prefix>.weight`) -> format, for every `<prefix>.qweight` tensor (FP8:
    every `<prefix>.weight_scale`)."""
    if quantization_method(hf_config) == "fp8":
        return {name.removesuffix("_scale"): Fp8Format() for name in tensor_names if name.endswith(".weight_scale")}
    fmt = GroupQuantFormat(quantization_method(hf_config), 4, group_size(hf_config))
    return {name.removesuffix(".qweight") + ".weight": fmt for name in tensor_names if name.endswith(".qweight")}


def _unpack_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight nibbles, low first, laid out along `dim` (8x longer)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    if dim == 0:
        return nibbles.permute(0, 2, 1).reshape(words.shape[0] * 8, words.shape[1])
    return nibbles.reshape(words.shape[0], words.shape[1] * 8)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ words [rows, out / 8] -> values [rows, out] in feature order."""
    nibbles = _unpack_words(words, 1).view(words.shape[0], -1, 8)  # [rows, out / 8, nibble]
    inverse = [AWQ_ORDER.index(j) for j in range(8)]  # feature j sits in nibble inverse[j]
    return nibbles[..., inverse].reshape(words.shape[0], -1)


def convert(parts: dict[str, torch.Tensor], method: str, hf_config: dict) -> QuantizedTensor:
    """One layer's qweight / qzeros / scales -> codes [out, in], scales and offsets [out, in / g]."""
    scales = parts["scales"].to(torch.float32)  # [in / g, out]
    if method == "awq":
        q = _awq_columns(parts["qweight"])  # [in, out]
        z = _awq_columns(parts["qzeros"])  # [in / g, out]
    else:
        q = _unpack_words(parts["qweight"], 0)  # [in, out]
        z = _unpack_words(parts["qzeros"], 1)  # [in / g, out]
        if hf_config["quantization_config"].get("checkpoint_format", "gptq") != "gptq_v2":
            z = z + 1
    size = group_size(hf_config)
    if q.shape[0] != scales.shape[0] * size or z.shape != scales.shape:
        raise ValueError(
            f"{method} shapes do not fit group size {size}: qweight gives {list(q.shape)}, scales "
            f"{list(scales.shape)}, qzeros gives {list(z.shape)}"
        )
    return QuantizedTensor(
        q.t().to(torch.uint8).contiguous(),
        scales.t().contiguous(),
        (-scales * z.to(torch.float32)).t().contiguous(),
    )


def _check_g_idx(name: str, g_idx: torch.Tensor, size: int) -> None:
    expected = torch.arange(g_idx.shape[0], dtype=torch.int64) // size
    if not torch.equal(g_idx.to(torch.int64), expected):
        raise ValueError(f"{name}: GPTQ g_idx reorders input features (act-order), which is not supported")


def iter_hf_quantized(
    weights: Iterator[tuple[str, torch.Tensor]], hf_config: dict, kept: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a checkpoint with every layer's int4 parts converted: for HF weight
    names in `kept` the three `<prefix>.weight_codes / _scales / _offsets` tensors, else the
    dequantized float32 `<prefix>.weight`. Other tensors pass through."""
    method = quantization_method(hf_config)
    if method == "fp8":
        yield from _iter_fp8(weights, kept)
        return
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part == "g_idx":
            _check_g_idx(name, tensor, group_size(hf_config))
            continue
        if part not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) < len(_PARTS):
            continue
        del pending[prefix]
        try:
            q = convert(parts, method, hf_config)
        except ValueError as exc:
            raise ValueError(f"{prefix}: {exc}") from exc
        if f"{prefix}.weight" in kept:
            yield f"{prefix}.weight_codes", q.codes
            yield f"{prefix}.weight_scales", q.scales
            yield f"{prefix}.weight_offsets", q.offsets
        else:
            yield f"{prefix}.weight", q.dequantize()
    for prefix, parts in pending.items():
        missing = ", ".join(p for p in _PARTS if p not in parts)
        raise ValueError(f"{prefix}: {method} checkpoint lacks {missing}")


def _iter_fp8(weights: Iterator[tuple[str, torch.Tensor]], kept: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """FP8 checkpoint tensors: a kept layer's float8 `weight` and its scales as [out, 1]; other
    FP8 weights dequantized to float32; input scales dropped; the rest as is."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part == "input_scale":
            continue
        if part not in ("weight", "weight_scale") or part == "weight" and tensor.dtype != FP8_DTYPE:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) < 2:
            continue
        del pending[prefix]
        weight, scale = parts["weight"], parts["weight_scale"].to(torch.float32)
        if scale.numel() not in (1, weight.shape[0]):
            raise ValueError(f"{prefix}: FP8 weight_scale of shape {list(scale.shape)} for a weight "
                             f"{list(weight.shape)} (one scale, or one per output feature, is supported)")  # fmt: skip
        scale = scale.reshape(-1, 1).expand(weight.shape[0], 1).contiguous()  # [out, 1]
        if f"{prefix}.weight" in kept:
            yield f"{prefix}.weight", weight
            yield f"{prefix}.weight_scale", scale
        else:
            yield f"{prefix}.weight", weight.float() * scale
    for prefix, parts in pending.items():
        missing = "weight_scale" if "weight" in parts else "weight"
        raise ValueError(f"{prefix}: fp8 checkpoint lacks {missing}")
