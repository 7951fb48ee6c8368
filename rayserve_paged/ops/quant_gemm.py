"""Weight-only group-quantized GEMM (Triton): y = x W^T with W dequantized inside the kernel.

    W[n, k] = scale[n, k // g] * code[n, k] + offset[n, k // g]      (float32, as models/quant.py)

    packed   uint8 [N, K / 2] for 4-bit codes (code k in the low nibble of byte k // 2 when k is
             even, in the high nibble when odd), uint8 [N, K] for 8-bit codes
    scales, offsets   float32 [N, K / g]
    x        [M, K] float16 / bfloat16 (float32 too); y [M, N] in x's dtype

One program computes a [BLOCK_M, BLOCK_N] tile of y over one K range, walking it in BLOCK_K
steps: it loads the tile's codes once, dequantizes them in float32 with their group's scale
and offset, and feeds `tl.dot` in x's dtype with a float32 accumulator (IEEE float32 products
for float32 operands, as the attention kernels: no TF32). The weight crosses memory as codes
(a quarter of float16 for 4-bit), which is what a decode step (M of a few rows) is bound by.

Two tiles (`gemm_constants`):

    decode  (<= DECODE_ROWS rows)  BLOCK_M 16, BLOCK_N 32, BLOCK_K = the group (up to 128; 64
            for float32 operands, which spilled at 128):
            one scale / offset load per K step, 64 contiguous code bytes per weight row
            (16-byte loads); split over K so that the grid has at least one program per SM
            (a 4096 x 4096 layer on 132 SMs: 128 column tiles x 2 K halves = 256 programs,
            where a 64-wide tile gave 64), each split's float32 partial summed after
    prefill (more rows)           BLOCK_M 64, BLOCK_N 64, BLOCK_K 32, no split

`num_rows` is not specialized on (`do_not_specialize`): a step's row count never compiles a
new variant. The K per split is always a multiple of 32, so its one specialization (divisible
by 16) holds at every launch and lets the compiler prove the code loads 16-byte aligned.

Compiled ahead of time for sm_80 / sm_89 / sm_90 with the attention kernels (ops/triton_aot.py);
tested on CPU under the Triton interpreter (tests/ops/test_quant_gemm.py), where bfloat16
operands go to `tl.dot` as float32 (`DOT_DTYPE`, as the attention kernels do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_backend import _num_sms  # the device's SM count (a nominal 132 off-GPU, as the attention plan)

BLOCK_K = 32  # the prefill tile's K step: divides every supported group size (32..128)
MAX_BLOCK_K = 128  # the decode tile's K step: the group size, up to this
DECODE_ROWS = 16  # up to this many rows: the decode tile (split over K)


@triton.jit(do_not_specialize=["num_rows"])
def group_quant_gemm_kernel(
    x_ptr, packed_ptr, scales_ptr, offsets_ptr, out_ptr,
    num_rows, out_features, in_features, stride_x_row, stride_out_row, k_per_split, stride_out_split,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # this program's K range: [pid_k * k_per_split, +k_per_split)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    row_mask = rows < num_rows
    col_mask = cols < out_features
    num_groups = in_features // GROUP_SIZE
    bytes_per_row = in_features * BITS // 8
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, in_features)  # k_per_split: a multiple of BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)  # [BK]
        x = tl.load(x_ptr + rows[:, None] * stride_x_row + ks[None, :], mask=row_mask[:, None], other=0.0)  # [BM, BK]
        if BITS == 4:  # each byte once (BK / 2 contiguous bytes a row), its two codes split after
            half = k_start // 2 + tl.arange(0, BLOCK_K // 2)  # [BK / 2]
            byte = tl.load(packed_ptr + cols[:, None] * bytes_per_row + half[None, :],
                           mask=col_mask[:, None], other=0)  # [BN, BK / 2] uint8  # fmt: skip
            code = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_N, BLOCK_K))  # [BN, BK]: low nibble first
        else:
            code = tl.load(packed_ptr + cols[:, None] * bytes_per_row + ks[None, :], mask=col_mask[:, None], other=0)
        group = k_start // GROUP_SIZE  # BLOCK_K divides the group: one group per step
        scale = tl.load(scales_ptr + cols * num_groups + group, mask=col_mask, other=0.0)  # [BN]
        offset = tl.load(offsets_ptr + cols * num_groups + group, mask=col_mask, other=0.0)  # [BN]
        weight = code.to(tl.float32) * scale[:, None] + offset[:, None]  # [BN, BK] float32
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(weight.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    out = out_ptr + pid_k * stride_out_split + rows[:, None] * stride_out_row + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def gemm_constants(dtype: torch.dtype, bits: int, group_size: int, num_rows: int, *, interpreted: bool) -> dict:
    """Constants (and num_warps) of group_quant_gemm_kernel: the decode tile up to DECODE_ROWS
    rows, the prefill tile above (see the module doc)."""
    if bits not in (4, 8) or group_size % BLOCK_K != 0:
        raise ValueError(f"group-quantized GEMM: {bits}-bit codes in groups of {group_size} (4 / 8 bits, groups of 32k)")
    wide = dtype == torch.float32 or (interpreted and dtype == torch.bfloat16)
    dot, precision = (tl.float32, "ieee") if wide else (_TL_DTYPES[dtype], "tf32")  # tf32: unused for 16-bit
    if num_rows <= DECODE_ROWS:
        widest = 64 if dtype == torch.float32 else MAX_BLOCK_K  # float32 at 128 spilled on sm_90
        block_k = next(k for k in (MAX_BLOCK_K, 64, BLOCK_K) if k <= widest and group_size % k == 0)
        tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k)
    else:
        tile = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=BLOCK_K)
    return dict(BITS=bits, GROUP_SIZE=group_size, DOT_DTYPE=dot, DOT_PRECISION=precision, **tile, num_warps=4)


def split_k(num_rows: int, out_features: int, in_features: int, constants: dict, num_sms: int) -> tuple[int, int]:
    """(splits, K per split) of a launch: the decode tile splits K until the grid has a
    program per SM (each split a whole number of BLOCK_K steps); the prefill tile never.

    >>> c = gemm_constants(torch.float16, 4, 128, 1, interpreted=False)
    >>> split_k(1, 4096, 4096, c, 132), split_k(1, 14336, 4096, c, 132), split_k(1, 64, 256, c, 132)
    ((2, 2048), (1, 4096), (2, 128))
    """
    if num_rows > DECODE_ROWS:
        return 1, in_features
    block_k = constants["BLOCK_K"]
    programs = triton.cdiv(num_rows, constants["BLOCK_M"]) * triton.cdiv(out_features, constants["BLOCK_N"])
    steps = in_features // block_k
    splits = max(1, min(steps, triton.cdiv(num_sms, programs)))
    k_per_split = triton.cdiv(steps, splits) * block_k
    return triton.cdiv(in_features, k_per_split), k_per_split


def out_dtype(num_rows: int, dtype: torch.dtype) -> torch.dtype:
    """What the kernel writes: float32 partials for the decode tile (summed after), x's dtype else."""
    return torch.float32 if num_rows <= DECODE_ROWS else dtype


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def is_interpreted() -> bool:
    """Whether the kernel was built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(group_quant_gemm_kernel, InterpretedFunction)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K] -> the kernel's layout: two per byte for 4 bits, as is for 8."""
    if bits == 8:
        return codes.contiguous()
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()  # [N, K / 2]


def group_quant_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for W held as (packed codes, scales, offsets); checks once."""
    num_rows, in_features = x.shape
    out_features = scales.shape[0]
    if in_features % group_size or scales.shape[1] * group_size != in_features or x.stride(1) != 1:
        raise ValueError(f"x {list(x.shape)} does not fit scales {list(scales.shape)} in groups of {group_size}")
    constants = gemm_constants(x.dtype, bits, group_size, num_rows, interpreted=is_interpreted())  # fmt: skip
    splits, k_per_split = split_k(num_rows, out_features, in_features, constants, _num_sms(x.device))
    out = torch.empty(splits, num_rows, out_features, dtype=out_dtype(num_rows, x.dtype), device=x.device)
    grid = (triton.cdiv(num_rows, constants["BLOCK_M"]), triton.cdiv(out_features, constants["BLOCK_N"]), splits)
    group_quant_gemm_kernel[grid](
        x, packed, scales, offsets, out, num_rows, out_features, in_features, x.stride(0), out.stride(1),
        k_per_split, out.stride(0), **constants,
    )  # fmt: skip
    if num_rows > DECODE_ROWS:  # the prefill tile: one split, written in x's dtype
        return out[0]
    return out.sum(0).to(x.dtype)  # [M, N]: the splits' float32 partials
