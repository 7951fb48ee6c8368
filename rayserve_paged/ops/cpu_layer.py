"""The compiled CPU decoder layer (csrc/decoder_layer_cpu.cpp): one call per layer per decode step.

    x, residual [T, hidden] float32, updated in place:
        residual = x (first layer) | residual + x
        x, residual = DecoderLayer(norm -> qkv -> RoPE -> KV write -> paged decode -> o -> + ->
                                   norm -> gate|up -> silu(gate) * up -> down)

For a decode step (one token per sequence) of a pre-norm SwiGLU layer whose four projections
are group-quantized codes in the compiled GEMM's layout (ops/quant_cpu.py): the GEMMs and the
attention are those kernels' own code (the source includes theirs), so the layer computes what
the op-by-op path computes, with the norms, RoPE and activation in C++ instead of ~60 torch
calls. What is fixed for a layer (weights, norms, caches, head counts) is marshalled once into
a ctypes structure (`DecodeLayer`); what a step shares (cos/sin, slots, block tables) once per
step (`DecodeStep`); a layer's call then passes two pointers and the two activations.

Built and cached like the other kernels (ops/cpu_decode.py); with no compiler, a failed build,
RAYSERVE_PAGED_CPU_KERNEL=0 or RAYSERVE_PAGED_CPU_FUSED_LAYER=0, `load()` returns None after
one log line and the model runs its layers op by op.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cpu_decode, quant_cpu
from .quant_cpu import PackedGroupQuant

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decoder_layer_cpu.cpp"
INCLUDES = (cpu_decode.SOURCE, quant_cpu.SOURCE)
SYMBOL = "rayserve_decoder_layer_decode_f32"
DISABLE_ENV = "RAYSERVE_PAGED_CPU_FUSED_LAYER"  # "0": decode steps run layer by layer in torch

_lock = threading.Lock()
_loaded: dict[str, DecoderLayerKernel | None] = {}

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Weight(ctypes.Structure):
    _fields_ = [("codes", _p), ("scales", _p), ("offsets", _p), ("bias", _p), ("num_rows", _i64),
                ("num_padded_rows", _i64), ("num_cols", _i64), ("group_size", _i64), ("bits", _i64)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("eps", _f32), ("qkv", _Weight), ("o", _Weight),
                ("gate_up", _Weight), ("down", _Weight), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("scale", _f32), ("window", _i64), ("soft_cap", _f32), ("key_cache", _p),
                ("value_cache", _p), ("num_blocks", _i64), ("block_size", _i64)]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _i64), ("hidden", _i64), ("cos", _p), ("sin", _p), ("slots", _p),
                ("block_tables", _p), ("seq_lens", _p), ("max_blocks", _i64), ("num_threads", ctypes.c_int32)]  # fmt: skip


@dataclass(slots=True)
class DecodeLayer:
    """One layer's fixed inputs, marshalled; `tensors` keeps what the pointers point into alive."""

    struct: _Layer
    hidden: int
    head_dim: int
    tensors: tuple


@dataclass(slots=True)
class DecodeStep:
    """What every layer of one step reads, marshalled (`tensors` keeps it alive)."""

    struct: _Step
    tensors: tuple


def _check_float(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"decoder layer kernel: {name} must be contiguous float32 on the CPU, got {tensor.dtype} "
                         f"on {tensor.device}, contiguous={tensor.is_contiguous()}")  # fmt: skip
    if tuple(tensor.shape) != shape:
        raise ValueError(f"decoder layer kernel: {name} has shape {tuple(tensor.shape)}, expected {shape}")


def _weight(name: str, weight: PackedGroupQuant, bias: torch.Tensor | None, rows: int, cols: int) -> _Weight:
    if (weight.out_features, weight.in_features) != (rows, cols):
        raise ValueError(f"decoder layer kernel: {name} is [{weight.out_features}, {weight.in_features}], "
                         f"expected [{rows}, {cols}]")  # fmt: skip
    if bias is not None:
        _check_float(f"{name} bias", bias, (rows,))
    return _Weight(
        weight.codes.data_ptr(), weight.scales.data_ptr(), weight.offsets.data_ptr(),
        0 if bias is None else bias.data_ptr(), rows, weight.codes.shape[0] * quant_cpu.LANES, cols,
        weight.group_size, weight.bits,
    )  # fmt: skip


def decode_layer(
    *,
    input_norm: torch.Tensor,  # [hidden]
    post_norm: torch.Tensor,  # [hidden]
    eps: float,
    qkv: tuple[PackedGroupQuant, torch.Tensor | None],  # [(H + 2 Hkv) D, hidden], bias
    o: tuple[PackedGroupQuant, torch.Tensor | None],  # [hidden, H D]
    gate_up: tuple[PackedGroupQuant, torch.Tensor | None],  # [2 I, hidden]
    down: tuple[PackedGroupQuant, torch.Tensor | None],  # [hidden, I]
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
) -> DecodeLayer:
    """Check and marshal one layer (ValueError naming what does not fit)."""
    hidden = input_norm.shape[0]
    inter = gate_up[0].out_features // 2
    _check_float("input norm", input_norm, (hidden,))
    _check_float("post-attention norm", post_norm, (hidden,))
    num_blocks, block_size = key_cache.shape[:2]
    _check_float("key cache", key_cache, (num_blocks, block_size, num_kv_heads, head_dim))
    _check_float("value cache", value_cache, (num_blocks, block_size, num_kv_heads, head_dim))
    if num_heads % num_kv_heads or head_dim % 2:
        raise ValueError(f"decoder layer kernel: {num_heads} heads over {num_kv_heads} kv heads of {head_dim}")
    if block_size < 1:  # the C code divides by it
        raise ValueError(f"decoder layer kernel: the block size must be >= 1, got caches {tuple(key_cache.shape)}")
    struct = _Layer(
        input_norm.data_ptr(), post_norm.data_ptr(), eps,
        _weight("qkv", *qkv, (num_heads + 2 * num_kv_heads) * head_dim, hidden),
        _weight("o", *o, hidden, num_heads * head_dim),
        _weight("gate_up", *gate_up, 2 * inter, hidden),
        _weight("down", *down, hidden, inter),
        num_heads, num_kv_heads, head_dim, scale, sliding_window or 0, soft_cap or 0.0,
        key_cache.data_ptr(), value_cache.data_ptr(), num_blocks, block_size,
    )  # fmt: skip
    kept = (input_norm, post_norm, *qkv, *o, *gate_up, *down, key_cache, value_cache)
    return DecodeLayer(struct, hidden, head_dim, kept)


def decode_step(
    hidden: int,
    cos: torch.Tensor,  # [T, D] float32
    sin: torch.Tensor,  # [T, D] float32
    slots: torch.Tensor,  # [T] int64 (-1: nothing written)
    block_tables: torch.Tensor,  # [T, max_blocks] int32
    seq_lens: torch.Tensor,  # [T] int32
) -> DecodeStep:
    """Check and marshal what the step's layers share (ValueError naming what does not fit)."""
    num_tokens, head_dim = cos.shape
    _check_float("cos", cos, (num_tokens, head_dim))
    _check_float("sin", sin, (num_tokens, head_dim))
    for name, tensor, dtype, shape in (("slots", slots, torch.int64, (num_tokens,)),
                                       ("block_tables", block_tables, torch.int32, (num_tokens, block_tables.shape[-1])),
                                       ("seq_lens", seq_lens, torch.int32, (num_tokens,))):  # fmt: skip
        if tensor.dtype != dtype or not tensor.is_contiguous() or tuple(tensor.shape) != shape:
            raise ValueError(f"decoder layer kernel: {name} must be contiguous {dtype} {shape}, got "
                             f"{tensor.dtype} {tuple(tensor.shape)}")  # fmt: skip
    struct = _Step(
        num_tokens, hidden, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), block_tables.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return DecodeStep(struct, (cos, sin, slots, block_tables, seq_lens))


class DecoderLayerKernel:
    """ctypes wrapper of the compiled layer."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = getattr(library, SYMBOL)
        self._fn.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Step), _p, _p, ctypes.c_int32, _p]
        self._fn.restype = ctypes.c_int
        self._bad = (ctypes.c_int64 * 2)()

    def __call__(self, layer: DecodeLayer, step: DecodeStep, x: torch.Tensor, residual: torch.Tensor,
                 is_first: bool) -> None:  # fmt: skip
        """x, residual [T, hidden] contiguous float32, updated in place (module docstring).
        Slots, block ids and lengths are range-checked inside before the caches are touched."""
        shape = (step.struct.num_tokens, layer.hidden)
        if x.shape != shape or residual.shape != shape or not (x.is_contiguous() and residual.is_contiguous()):
            raise ValueError(f"decoder layer kernel: x {tuple(x.shape)} and residual {tuple(residual.shape)} "
                             f"must be contiguous {shape}")  # fmt: skip
        if step.struct.hidden != layer.hidden or step.tensors[0].shape[1] != layer.head_dim:
            raise ValueError("decoder layer kernel: the step was marshalled for another layer shape")
        status = self._fn(ctypes.byref(layer.struct), ctypes.byref(step.struct), x.data_ptr(), residual.data_ptr(),
                          int(is_first), self._bad)  # fmt: skip
        if status:
            raise ValueError(self._error(status, layer, step))

    def _error(self, status: int, layer: DecodeLayer, step: DecodeStep) -> str:
        seq, position = self._bad[0], self._bad[1]
        _, slots, tables, seq_lens = step.tensors[1:]
        block_size, num_blocks = layer.struct.block_size, layer.struct.num_blocks
        if status == 1:
            return (f"decode seq_lens[{seq}]={int(seq_lens[seq])} is negative or does not fit "
                    f"{tables.shape[1]} blocks of {block_size} tokens")  # fmt: skip
        if status == 2:
            return (f"decode block_tables[{seq}, {position}]={int(tables[seq, position])} is outside the cache's "
                    f"[0, {num_blocks}) blocks")  # fmt: skip
        if status == 3:
            return f"slot_mapping[{seq}]={int(slots[seq])} is outside the cache's {num_blocks * block_size} slots"
        return "decoder layer kernel: a group-quantized GEMM refused its shapes"


def load() -> DecoderLayerKernel | None:
    """The kernel, built on first use in this machine's cache; None when it cannot be had.
    Decided once per process (one log line either way)."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _build_and_load()
        return _loaded["kernel"]


def _build_and_load() -> DecoderLayerKernel | None:
    for env in (cpu_decode.DISABLE_ENV, DISABLE_ENV):
        if os.environ.get(env, "1") == "0":
            logger.info("compiled CPU decoder layer disabled (%s=0): decode steps run layer by layer", env)
            return None
    kernel = cpu_decode.build_and_load(
        DecoderLayerKernel, "compiled CPU decoder layer", "decode steps run layer by layer", SOURCE, cpu_decode.FLAGS,
        INCLUDES,
    )
    if kernel is not None:
        logger.info("decode steps of group-quantized CPU models: one compiled call per layer (%s)", kernel.path.name)
    return kernel
