"""Weight-only group-quantized GEMM (Triton): y = x W^T with W dequantized inside the kernel.

    W[n, k] = scale[n, k // g] * code[n, k] + offset[n, k // g]      (float32, as models/quant.py)

    packed   uint8 [N, K / 2] for 4-bit codes (code k in the low nibble of byte k // 2 when k is
             even, in the high nibble when odd), uint8 [N, K] for 8-bit codes
    scales, offsets   float32 [N, K / g]
    x        [M, K] float16 / bfloat16 (float32 too); y [M, N] in x's dtype

One program computes a [BLOCK_M, BLOCK_N] tile of y, walking K in BLOCK_K steps: it loads the
tile's codes once, dequantizes them in float32 with their group's scale and offset, and feeds
`tl.dot` in x's dtype with a float32 accumulator. The weight crosses memory as codes (a
quarter of float16 for 4-bit), which is what a decode step (M of a few rows) is bound by.

Compiled ahead of time for sm_80 / sm_89 / sm_90 with the attention kernels (ops/triton_aot.py);
tested on CPU under the Triton interpreter (tests/ops/test_quant_gemm.py), where bfloat16
operands go to `tl.dot` as float32 (`DOT_DTYPE`, as the attention kernels do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 32  # divides every supported group size (32..128), so a K step never straddles a group


@triton.jit
def group_quant_gemm_kernel(
    x_ptr, packed_ptr, scales_ptr, offsets_ptr, out_ptr,
    num_rows, out_features, in_features, stride_x_row, stride_out_row,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    row_mask = rows < num_rows
    col_mask = cols < out_features
    num_groups = in_features // GROUP_SIZE
    bytes_per_row = in_features * BITS // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)  # [BK]
        x = tl.load(x_ptr + rows[:, None] * stride_x_row + ks[None, :], mask=row_mask[:, None], other=0.0)  # [BM, BK]
        if BITS == 4:
            byte = tl.load(packed_ptr + cols[:, None] * bytes_per_row + ks[None, :] // 2,
                           mask=col_mask[:, None], other=0)  # [BN, BK] uint8  # fmt: skip
            code = (byte >> ((ks[None, :] % 2) * 4).to(tl.uint8)) & 0xF
        else:
            code = tl.load(packed_ptr + cols[:, None] * bytes_per_row + ks[None, :], mask=col_mask[:, None], other=0)
        group = k_start // GROUP_SIZE
        scale = tl.load(scales_ptr + cols * num_groups + group, mask=col_mask, other=0.0)  # [BN]
        offset = tl.load(offsets_ptr + cols * num_groups + group, mask=col_mask, other=0.0)  # [BN]
        weight = code.to(tl.float32) * scale[:, None] + offset[:, None]  # [BN, BK] float32
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(weight.to(DOT_DTYPE)))
    out = out_ptr + rows[:, None] * stride_out_row + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def gemm_constants(dtype: torch.dtype, bits: int, group_size: int, num_rows: int, *, interpreted: bool) -> dict:
    """Constants (and num_warps) of group_quant_gemm_kernel; BLOCK_M follows the batch (16 for
    decode steps, 64 for prefill), the weight tile is [64, 32]."""
    if bits not in (4, 8) or group_size % BLOCK_K != 0:
        raise ValueError(f"group-quantized GEMM: {bits}-bit codes in groups of {group_size} (4 / 8 bits, groups of 32k)")
    dot = tl.float32 if dtype == torch.float32 or (interpreted and dtype == torch.bfloat16) else _TL_DTYPES[dtype]
    return dict(BITS=bits, GROUP_SIZE=group_size, DOT_DTYPE=dot, BLOCK_M=16 if num_rows <= 16 else 64, BLOCK_N=64,
                BLOCK_K=BLOCK_K, num_warps=4)  # fmt: skip


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
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    constants = gemm_constants(x.dtype, bits, group_size, num_rows, interpreted=is_interpreted())  # fmt: skip
    grid = (triton.cdiv(num_rows, constants["BLOCK_M"]), triton.cdiv(out_features, constants["BLOCK_N"]))
    group_quant_gemm_kernel[grid](
        x, packed, scales, offsets, out, num_rows, out_features, in_features, x.stride(0), out.stride(0), **constants
    )
    return out
