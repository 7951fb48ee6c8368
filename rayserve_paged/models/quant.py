"""Weight formats behind one seam: how a linear layer (or an embedding) holds its weight and
computes y = x W^T, in the spirit of vLLM's "linear method".

    checkpoint ──> the method's parameters (checkpoint form) ──> layer.load_weight: this
       rank's shard, by the same narrow as a float weight ──> method.process_weights_after_loading:
       repacked once into the kernels' form ──> method.apply(layer, x) at every step

UnquantizedLinearMethod   `weight` [out, in] in the model dtype; F.linear.
GroupQuantLinearMethod    weight-only 4- or 8-bit codes with a scale and an offset per group of
                          `group_size` input features:

                              W[n, k] = scale[n, k // g] * code[n, k] + offset[n, k // g]

                          in float32. GGUF Q4_0 / Q4_1 / Q8_0 and AWQ / GPTQ (zero points
                          folded into the offset) all dequantize exactly in this form, so it is
                          the one the loaders convert to (gguf.py, hf_quant.py).

Parameters of a group-quantized layer (output features first, so column- and row-parallel
sharding narrow them exactly as they narrow a float weight; a group never straddles ranks):

    weight_codes    uint8   [out, in]       codes in [0, 2^bits)
    weight_scales   float32 [out, in / g]
    weight_offsets  float32 [out, in / g]

Kernels (chosen once per process, `cpu_kernel_plan`): on a CPU with AVX-512 and a C++
compiler, the compiled float32 kernel of ops/quant_cpu.py, at every batch size and for the LM head and
embedding too (the codes are held once, in its layout; products and sums in float32, so the
float32 path's product of the same weights up to summation order). Otherwise, on CPUs with
AVX512-BF16 or AMX, torch's packed int4 kernel `_weight_int4pack_mm_for_cpu` with
bfloat16 activations for batches of up to `max_packed_rows` rows and a dense bfloat16 copy of
the dequantized weight above that; 8-bit codes run as two int4 planes (high and low nibble,
see `_planes`), and every plane runs twice, with the bfloat16 head and rest of its float32
scales and zeros (`_split_scales_and_zeros`: one bfloat16 scale per group changes SmolLM2's
answers); the LM head (`is_logits`) then multiplies by its dequantized weight in the model
dtype (bfloat16 logits flip greedy answers: "The capital of France is Paris." became
"L'Étoile, la Marseillaise, ..."). Elsewhere the weight is dequantized once into the model
dtype and F.linear runs on it: the codes still load (and shard) the same way. On CUDA devices
the codes stay packed (two per byte for 4 bits) and the Triton kernel of ops/quant_gemm.py
dequantizes them tile by tile inside the GEMM (compiled ahead of time with the attention
kernels; tested under the interpreter, not yet timed on a GPU).

Fp8LinearMethod          FP8 e4m3 weights with a float32 scale per output feature; torch's FP8
                          GEMM on CUDA sm_89+, dequantized at load elsewhere (its docstring).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rayserve_paged.ops import quant_cpu

logger = logging.getLogger(__name__)

CPU_INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu takes
QUANT_PARAM_NAMES = ("weight_codes", "weight_scales", "weight_offsets")


@dataclass(frozen=True, slots=True)
class GroupQuantFormat:
    """A weight-only group-quantized format, as a checkpoint stores it."""

    name: str  # "Q4_1", "awq", "gptq", ...: for logs and errors
    bits: int  # 4 or 8
    group_size: int

    def make_method(self) -> LinearMethod:
        return GroupQuantLinearMethod(self)


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A full (unsharded) checkpoint weight in the GroupQuant form, dequantizable exactly."""

    codes: torch.Tensor  # [out, in] uint8
    scales: torch.Tensor  # [out, in / g] float32
    offsets: torch.Tensor  # [out, in / g] float32

    @property
    def group_size(self) -> int:
        return self.codes.shape[-1] // self.scales.shape[-1]

    def dequantize(self) -> torch.Tensor:
        return dequantize_groups(self.codes, self.scales, self.offsets)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """float32 W = scale * code + offset, one scale and offset per group of input features."""
    group_size = codes.shape[-1] // scales.shape[-1]
    shape = (*codes.shape[:-1], scales.shape[-1], group_size)
    grouped = codes.to(torch.float32).view(shape) * scales.unsqueeze(-1) + offsets.unsqueeze(-1)
    return grouped.view(codes.shape)  # [out, in]


# --------------------------------------------------------------------------- kernel plan


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """How group-quantized layers compute: on this CPU (`cpu_kernel_plan`), or on CUDA."""

    is_packed: bool  # torch's packed int4 kernels; else dequantized float weights
    activation_dtype: torch.dtype  # what the packed kernels and the dense copy run in
    max_packed_rows: int  # batches with more rows use the dense copy (0: never packed)
    reason: str
    is_triton: bool = False  # CUDA: the Triton group-quantized GEMM (ops/quant_gemm.py) instead
    is_compiled: bool = False  # CPU: the compiled float32 kernel (ops/quant_cpu.py) instead


# The compiled kernel's plan: float32 in and out, the codes kept in its layout at every batch size.
COMPILED = KernelPlan(False, torch.float32, 0, "compiled group-quantized CPU kernel, float32", is_compiled=True)


# Rows up to which the packed int4 kernel beats a dense bfloat16 GEMM on SmolLM2's shapes
# (the four projections of a layer over all 30 layers, weights streamed from memory as in a
# decode step, one thread; docs/benchmarks/15-quantized.md).
PACKED_MAX_ROWS = 4


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@functools.cache
def cpu_kernel_plan() -> KernelPlan:
    """The per-machine choice, made and logged once per process: the compiled kernel on CPUs
    with AVX-512 where it builds (its build without AVX-512 measured slower than float32 GEMM,
    docs/benchmarks/15-quantized.md (15a)), else torch's packed int4 kernels where the CPU has bfloat16
    instructions, else weights dequantized at load."""
    flags = _cpu_flags()
    if "avx512f" in flags and quant_cpu.load() is not None:
        logger.info("quantized linear layers: the compiled group-quantized CPU kernel (float32, codes kept at every "
                    "batch size; LM head and embedding too)")  # fmt: skip
        return COMPILED
    has_kernels = hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")
    bf16 = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if has_kernels and bf16:
        plan = KernelPlan(True, torch.bfloat16, PACKED_MAX_ROWS, f"CPU has {' '.join(bf16)}")
    else:
        why = "torch lacks the packed int4 CPU kernels" if not has_kernels else "CPU has neither avx512_bf16 nor amx_bf16"
        plan = KernelPlan(False, torch.float32, 0, f"{why} ({platform.machine()})")
    if plan.is_packed:
        logger.info(
            "quantized linear layers: packed int4 kernels in %s for batches of up to %d rows, a dense %s copy "
            "above (%s)", plan.activation_dtype, plan.max_packed_rows, plan.activation_dtype, plan.reason,
        )  # fmt: skip
    else:
        logger.info("quantized linear layers: dequantized to the model dtype once at load (%s)", plan.reason)
    return plan


# --------------------------------------------------------------------------- methods


def _new_param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LinearMethod:
    """A weight format: creates a layer's weight parameters, repacks them once, multiplies."""

    param_names: tuple[str, ...] = ("weight",)
    bits: int | None = None  # None: float weights

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int, dtype: torch.dtype | None) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once, after every parameter is loaded."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] in the model dtype -> [T, out] in the model dtype, no bias."""
        raise NotImplementedError

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (embedding lookups): [T] -> [T, in] in the model dtype."""
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """This rank's weight [out, in] as the layer multiplies by it, in float32."""
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer, output_size, input_size, dtype) -> None:
        layer.weight = _new_param(output_size, input_size, dtype=dtype)  # [out, in]

    def apply(self, layer, x):
        return F.linear(x, layer.weight)

    def embed(self, layer, ids):
        return F.embedding(ids, layer.weight)

    def dequantize(self, layer):
        return layer.weight.float()


UNQUANTIZED = UnquantizedLinearMethod()


class GroupQuantLinearMethod(LinearMethod):
    """Weight-only group-quantized codes (module docstring); `plan` decides the kernel."""

    param_names = QUANT_PARAM_NAMES

    def __init__(self, fmt: GroupQuantFormat, plan: KernelPlan | None = None) -> None:
        if fmt.bits not in (4, 8):
            raise ValueError(f"{fmt.name}: {fmt.bits}-bit weights are not supported (4 and 8 are)")
        self.format = fmt
        self.bits = fmt.bits
        self.group_size = fmt.group_size
        self.plan = plan

    def create_weights(self, layer, output_size, input_size, dtype) -> None:
        if input_size % self.group_size != 0:
            raise ValueError(
                f"{self.format.name}: {input_size} input features per rank are not a multiple of the group size "
                f"{self.group_size}"
            )
        num_groups = input_size // self.group_size
        layer.weight_codes = _new_param(output_size, input_size, dtype=torch.uint8)  # [out, in]
        layer.weight_scales = _new_param(output_size, num_groups, dtype=torch.float32)  # [out, in / g]
        layer.weight_offsets = _new_param(output_size, num_groups, dtype=torch.float32)  # [out, in / g]
        layer.model_dtype = dtype or torch.get_default_dtype()

    def _plan_for(self, layer: nn.Module) -> KernelPlan:
        device = layer.weight_codes.device
        if self.plan is not None and self.plan.is_compiled or self.plan is None and device.type == "cpu":
            plan = self.plan or cpu_kernel_plan()
            if plan.is_compiled and self.group_size % 2 == 0:
                return plan  # float32 products, logits included
        if layer.is_logits:
            return KernelPlan(False, layer.model_dtype, 0, "logits in the model dtype")
        if self.plan is not None:
            return self.plan
        if device.type == "cuda" and self.group_size % 32 == 0 and importlib.util.find_spec("triton") is not None:
            return KernelPlan(False, layer.model_dtype, 0, "Triton group-quantized GEMM", is_triton=True)
        if device.type != "cpu" or self.group_size not in CPU_INT4_GROUP_SIZES:
            return KernelPlan(False, layer.model_dtype, 0, f"no packed kernel for {device.type}, g={self.group_size}")
        return cpu_kernel_plan()

    def process_weights_after_loading(self, layer) -> None:
        """Repack once: the kernels' form for layers that multiply (`is_matmul`); the codes
        stay only where rows are looked up (`keeps_codes`: embeddings) and no dense weight in
        the model dtype holds them (a tied LM head's)."""
        plan = layer.kernel_plan = self._plan_for(layer)
        layer.int4_planes = ()
        layer.dense_weight = None
        layer.packed_codes = None
        layer.packed_weight = None
        if plan.is_compiled:  # one copy in the kernel's layout, for products and row lookups
            layer.gemm = quant_cpu.load()
            layer.packed_weight = quant_cpu.pack(layer.weight_codes, layer.weight_scales, layer.weight_offsets, self.bits)
            for name in QUANT_PARAM_NAMES:
                param = getattr(layer, name)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            return
        if layer.is_matmul and plan.is_triton:
            from rayserve_paged.ops.quant_gemm import pack_codes

            layer.packed_codes = pack_codes(layer.weight_codes.data, self.bits)  # [out, in * bits / 8]
        elif layer.is_matmul:
            weight = dequantize_groups(layer.weight_codes, layer.weight_scales, layer.weight_offsets)  # [out, in]
            layer.dense_weight = weight.to(plan.activation_dtype if plan.is_packed else layer.model_dtype)
            if plan.is_packed:
                layer.int4_planes = _planes(layer.weight_codes, layer.weight_scales, layer.weight_offsets, self.bits, plan)
        if not layer.keeps_codes or layer.dense_weight is not None and not plan.is_packed:
            # rows are looked up in the dense weight when there is one in the model dtype
            layer.weight_codes.data = torch.empty(0, dtype=torch.uint8, device=layer.weight_codes.device)

    def apply(self, layer, x):
        plan = layer.kernel_plan
        if plan.is_compiled:
            return layer.gemm(x, layer.packed_weight).to(x.dtype)  # [T, out] float32 products
        if plan.is_triton:
            from rayserve_paged.ops.quant_gemm import group_quant_matmul

            scales, offsets = layer.weight_scales, layer.weight_offsets
            return group_quant_matmul(x, layer.packed_codes, scales, offsets, self.bits, self.group_size)
        if not plan.is_packed:
            return F.linear(x, layer.dense_weight)
        xa = x.to(plan.activation_dtype)
        if x.shape[0] > plan.max_packed_rows:
            y = F.linear(xa, layer.dense_weight)
        else:
            y = torch.zeros(x.shape[0], layer.weight_scales.shape[0], dtype=torch.float32)  # [T, out]
            for packed, pairs in layer.int4_planes:
                for scales_and_zeros in pairs:
                    y += torch._weight_int4pack_mm_for_cpu(xa, packed, self.group_size, scales_and_zeros)
        return y.to(x.dtype)

    def embed(self, layer, ids):
        if layer.packed_weight is not None:
            return dequantize_groups(*layer.packed_weight.rows(ids)).to(layer.model_dtype)  # [T, in]
        if not layer.weight_codes.numel():
            return F.embedding(ids, layer.dense_weight)  # [T, in]
        rows = dequantize_groups(layer.weight_codes[ids], layer.weight_scales[ids], layer.weight_offsets[ids])
        return rows.to(layer.model_dtype)  # [T, in]

    def dequantize(self, layer):
        """From the repacked form: the planes' codes (read back through the kernel) or the kept
        codes, with the float32 scales and offsets; equals the checkpoint's dequantized weight
        bit for bit. Without either (dequantized at load): the dense weight."""
        if layer.packed_weight is not None:
            return dequantize_groups(*layer.packed_weight.unpack())
        out_features, num_groups = layer.weight_scales.shape
        if layer.int4_planes:
            planes = [unpack_int4(packed, out_features, num_groups * self.group_size) for packed, _ in layer.int4_planes]
            codes = (planes[0] if self.bits == 4 else planes[0] * 16 + planes[1]).to(torch.uint8)  # high nibble first
        elif layer.packed_codes is not None:
            packed = layer.packed_codes
            codes = packed if self.bits == 8 else torch.stack([packed & 15, packed >> 4], dim=-1).flatten(1)
        elif layer.weight_codes.numel():
            codes = layer.weight_codes
        else:
            return layer.dense_weight.float()
        return dequantize_groups(codes, layer.weight_scales, layer.weight_offsets)


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """FP8 (e4m3) weights with one float32 scale per output feature: W = scale[n] * w8[n, k]
    (a per-tensor checkpoint scale is the same scale for every feature)."""

    name: str = "fp8"

    def make_method(self) -> LinearMethod:
        return Fp8LinearMethod()


def fp8_scaled_mm_supported(device: torch.device, out_features: int = 16, in_features: int = 16) -> bool:
    """Whether torch's FP8 GEMM (`torch._scaled_mm`) serves this device and weight: CUDA
    sm_89 / sm_90+, both weight dims multiples of 16 (cuBLASLt's FP8 alignment; any row count)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or out_features % 16 or in_features % 16:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8LinearMethod(LinearMethod):
    """FP8 weights (`weight` float8_e4m3fn [out, in]) and per-output-feature scales
    (`weight_scale` float32 [out, 1], kept whole by row-parallel shards: `is_per_output`).

    On CUDA sm_89+ the weight stays FP8 and each product is torch's FP8 GEMM: activations
    quantized per call with one dynamic scale (amax / 448), `torch._scaled_mm` with float32
    output, then the per-feature weight scales. Elsewhere the weight is dequantized once into
    the model dtype and F.linear runs on it. `use_scaled_mm=True` forces the FP8 GEMM (torch
    serves it on the CPU too, which is how the tests run it)."""

    param_names = ("weight", "weight_scale")
    bits = 8

    def __init__(self, use_scaled_mm: bool | None = None) -> None:
        self.use_scaled_mm = use_scaled_mm

    def create_weights(self, layer, output_size, input_size, dtype) -> None:
        layer.weight = _new_param(output_size, input_size, dtype=FP8_DTYPE)  # [out, in]
        layer.weight_scale = _new_param(output_size, 1, dtype=torch.float32)  # [out, 1]
        layer.weight_scale.is_per_output = True
        layer.model_dtype = dtype or torch.get_default_dtype()

    def process_weights_after_loading(self, layer) -> None:
        device = layer.weight.device
        serves = self.use_scaled_mm
        layer.fp8_scaled_mm = fp8_scaled_mm_supported(device, *layer.weight.shape) if serves is None else serves
        layer.dense_weight = None if layer.fp8_scaled_mm else self.dequantize(layer).to(layer.model_dtype)
        layer.scale_row = layer.weight_scale.data.t().contiguous()  # [1, out]

    def apply(self, layer, x):
        if not layer.fp8_scaled_mm:
            return F.linear(x, layer.dense_weight)
        x_scale = (x.abs().amax().float() / FP8_MAX).clamp(min=1e-12)  # one dynamic scale per call
        x8 = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [T, in]
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(x8, layer.weight.t(), scale_a=x_scale, scale_b=one, out_dtype=torch.float32)  # [T, out]
        return (y * layer.scale_row).to(x.dtype)

    def embed(self, layer, ids):
        return (F.embedding(ids, layer.weight).float() * layer.weight_scale[ids]).to(layer.model_dtype)

    def dequantize(self, layer):
        return layer.weight.float() * layer.weight_scale.float()  # [out, in]


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [out, in] -> (float8_e4m3fn [out, in], float32 scales [out, 1]): one
    scale per output feature, amax / 448 (what FP8 checkpoints with channel scales hold)."""
    scale = (weight.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [out, 1]
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tinygemm's [in / g, out, 2] (scale, zero) pairs: w = (q - 8) * scale + zero."""
    return torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)


def _split_scales_and_zeros(
    scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(head, rest) pairs of `dtype` values whose sum is the float32 (scale, zero) to ~16 bits.

    A float16 scale (11 significant bits) rounded to bfloat16 (8) is off by up to 2^-9 for the
    whole group, the same way for its 32 weights; SmolLM2's greedy answers change with it. The
    kernel runs once per pair on the same packed codes and the two products are added."""
    head = _scales_and_zeros(scales, zeros, dtype)
    rest = _scales_and_zeros(scales, zeros, torch.float32) - head.to(torch.float32)
    return head, rest.to(dtype)


def _planes(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, plan: KernelPlan
) -> tuple[tuple[torch.Tensor, tuple[torch.Tensor, ...]], ...]:
    """(packed int4 weight, its (scale, zero) pairs) per plane; the products sum to x W^T.

    4-bit: one plane, zero = offset + 8 * scale. 8-bit: code = 16 * high + low with both
    nibbles in [0, 16), so  W = 16s * high + offset  +  s * low:
        high plane: scale 16s, zero 128s + offset;   low plane: scale s, zero 8s.
    """
    if bits == 4:
        pairs = [(codes, scales, offsets + 8 * scales)]
    else:
        high, low = codes >> 4, codes & 15
        pairs = [(high, 16 * scales, 128 * scales + offsets), (low, scales, 8 * scales)]
    return tuple(
        (torch._convert_weight_to_int4pack_for_cpu(plane.to(torch.int32).contiguous(), 1),
         _split_scales_and_zeros(s, z, plan.activation_dtype))
        for plane, s, z in pairs
    )  # fmt: skip


def unpack_int4(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The codes [out, in] of a CPU-packed int4 weight, read back through the kernel itself
    (an identity input with scale 1 and zero 8 returns q exactly; the layout stays torch's)."""
    group_size = max(g for g in CPU_INT4_GROUP_SIZES if in_features % g == 0)
    eye = torch.eye(in_features, dtype=torch.bfloat16)
    ones = torch.ones(out_features, in_features // group_size, dtype=torch.float32)
    sz = _scales_and_zeros(ones, 8 * ones, torch.bfloat16)
    return torch._weight_int4pack_mm_for_cpu(eye, packed, group_size, sz).t().to(torch.int32)  # [out, in]
