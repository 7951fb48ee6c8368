"""The compiled CPU group-quantized GEMM (csrc/quant_gemm_cpu.cpp): layout, build, call.

    y [M, N] float32 = x [M, K] float32  @  W^T,   W[n, k] = scale[n, g] * code[n, k] + offset[n, g]

with W held as 4- or 8-bit codes in blocks of 16 output rows (`pack`), float32 scales and
offsets per group of input features; the products and sums are float32 (no bfloat16 anywhere),
so the layer computes what the float32 dequantized path computes, summed in another order.
Built and cached like the paged-decode kernel (ops/cpu_decode.py: same cache directory, same
compiler, -march=native); with no compiler, a failed build or RAYSERVE_PAGED_CPU_KERNEL=0,
`load()` returns None after one log line and the caller keeps another plan.

Layout (`pack`), N padded up to a multiple of 16 with zero rows:

    codes    [N / 16, K / 2, 16] uint8 (4-bit: low nibble column 2p, high nibble 2p + 1)
             [N / 16, K, 16]     uint8 (8-bit)
    scales   [N / 16, K / g, 16] float32, offsets the same
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cpu_decode

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "quant_gemm_cpu.cpp"
SYMBOL = "rayserve_group_quant_gemm_f32"
LANES = 16  # output rows per block of the layout

_lock = threading.Lock()
_loaded: dict[tuple[str, ...], GroupQuantGemmKernel | None] = {}


@dataclass(frozen=True, slots=True)
class PackedGroupQuant:
    """A weight in the kernel's layout (module docstring)."""

    codes: torch.Tensor  # [N pad / 16, K * bits / 8, 16] uint8
    scales: torch.Tensor  # [N pad / 16, K / g, 16] float32
    offsets: torch.Tensor  # [N pad / 16, K / g, 16] float32
    out_features: int  # N (the padded rows are zero and never returned)
    in_features: int
    bits: int

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes [T, K] uint8, scales and offsets [T, K / g] of output rows `ids` [T]."""
        block, lane = ids // LANES, ids % LANES
        codes = self.codes[block, :, lane]  # [T, K * bits / 8]
        if self.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(1)  # [T, K]
        return codes, self.scales[block, :, lane], self.offsets[block, :, lane]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes [N, K], scales and offsets [N, K / g] it was packed from, exactly."""
        return self.rows(torch.arange(self.out_features))


def _blocks(t: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """[N, C] -> [N pad / 16, C, 16], zero rows appended."""
    if padded_rows != t.shape[0]:
        t = torch.cat([t, t.new_zeros(padded_rows - t.shape[0], t.shape[1])])
    return t.view(padded_rows // LANES, LANES, t.shape[1]).transpose(1, 2).contiguous()


def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int) -> PackedGroupQuant:
    """codes [N, K] uint8 (values < 2^bits), scales / offsets [N, K / g] float32 -> the layout."""
    if bits not in (4, 8):
        raise ValueError(f"the CPU group-quantized kernel takes 4- or 8-bit codes, not {bits}")
    out_features, in_features = codes.shape
    padded = -(-out_features // LANES) * LANES
    if bits == 4:
        pairs = codes.view(out_features, in_features // 2, 2)
        codes = pairs[..., 0] | (pairs[..., 1] << 4)  # [N, K / 2]
    return PackedGroupQuant(
        _blocks(codes.to(torch.uint8), padded),
        _blocks(scales.to(torch.float32), padded),
        _blocks(offsets.to(torch.float32), padded),
        out_features, in_features, bits,
    )  # fmt: skip


class GroupQuantGemmKernel:
    """ctypes wrapper of the compiled kernel."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = getattr(library, SYMBOL)
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    def __call__(self, x: torch.Tensor, weight: PackedGroupQuant) -> torch.Tensor:
        """x [M, K] float32 -> y [M, N] float32 (x is made contiguous float32 if it is not)."""
        if x.dim() != 2 or x.shape[1] != weight.in_features or x.device.type != "cpu":
            raise ValueError(f"group-quantized GEMM: x {tuple(x.shape)} on {x.device} does not fit a weight "
                             f"[{weight.out_features}, {weight.in_features}] on the CPU")  # fmt: skip
        x = x.to(torch.float32).contiguous()
        padded = weight.codes.shape[0] * LANES
        y = torch.empty(x.shape[0], padded, dtype=torch.float32)  # [M, N pad]
        status = self._fn(
            x.data_ptr(), y.data_ptr(), weight.codes.data_ptr(), weight.scales.data_ptr(), weight.offsets.data_ptr(),
            x.shape[0], padded, weight.in_features, weight.group_size, weight.bits, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"group-quantized GEMM: the kernel refused K={weight.in_features}, "
                             f"group size {weight.group_size}, {weight.bits} bits")  # fmt: skip
        return y if padded == weight.out_features else y[:, : weight.out_features]


def load(extra_flags: tuple[str, ...] = ()) -> GroupQuantGemmKernel | None:
    """The kernel, built on first use in this machine's cache; None when it cannot be had.
    Decided once per process and flag set (one log line either way); `extra_flags` builds a
    variant (the tests build the portable one with -mno-avx512f)."""
    with _lock:
        if extra_flags not in _loaded:
            _loaded[extra_flags] = _build_and_load(extra_flags)
        return _loaded[extra_flags]


def _build_and_load(extra_flags: tuple[str, ...]) -> GroupQuantGemmKernel | None:
    if os.environ.get(cpu_decode.DISABLE_ENV, "1") == "0":
        logger.info("CPU group-quantized kernel disabled (%s=0)", cpu_decode.DISABLE_ENV)
        return None
    return cpu_decode.build_and_load(
        GroupQuantGemmKernel, "CPU group-quantized kernel", "quantized layers keep another plan", SOURCE,
        cpu_decode.FLAGS + extra_flags,
    )
