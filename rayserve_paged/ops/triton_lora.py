"""The LoRA contribution on the GPU (Triton): y[t] += (x[t] A[s]^T) B[s]^T for each token t
whose row runs the adapter in slot s (ops/lora.py draws the pool layout), in two kernels, one
program per (token, tile) as punica's BGMV does:

    lora_shrink   xa [T, W] float32 = x [T, in] . A[slot]^T      (W = the pool's rank width)
    lora_expand   y  [T, out]      += xa . B[slot]^T             (in y's dtype, fp32 sums)

A token of slot -1 (the base model) costs one load of its slot: shrink writes zeros, expand
leaves y as it is. Every adapter of the batch is read by its own tokens only, so a step
mixing many adapters costs what one adapter costs per token. Compiled ahead of time with the
attention kernels (ops/triton_aot.py); tested on CPU under the Triton interpreter against
`lora_reference` (tests/ops/test_triton_lora.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # input features per shrink step
BLOCK_N = 64  # output features per expand program
BLOCK_W = 16  # rank columns per expand step (the pool's width is a multiple of the rank, >= 1)


@triton.jit
def _rows_dot(m_ptr, v_ptr, rows, row_mask, num_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """[BLOCK_ROWS] float32: M[rows] . v, M row-major [*, num_cols] at m_ptr, v [num_cols] at
    v_ptr, summed over column tiles of BLOCK_COLS in float32 (the shape of both LoRA products)."""
    acc = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for c_start in range(0, num_cols, BLOCK_COLS):
        cs = c_start + tl.arange(0, BLOCK_COLS)  # [BC]
        c_mask = cs < num_cols
        v = tl.load(v_ptr + cs, mask=c_mask, other=0.0).to(tl.float32)  # [BC]
        m = tl.load(m_ptr + rows[:, None] * num_cols + cs[None, :],
                    mask=row_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)  # [BR, BC]  # fmt: skip
        acc += tl.sum(m * v[None, :], axis=1)
    return acc


@triton.jit
def lora_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, xa_ptr,
    in_features, lora_width, stride_x_row, stride_a_slot,
    BLOCK_W_SHRINK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    pid_w = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    ws = pid_w * BLOCK_W_SHRINK + tl.arange(0, BLOCK_W_SHRINK)  # [BW]
    w_mask = ws < lora_width
    acc = tl.zeros((BLOCK_W_SHRINK,), dtype=tl.float32)
    if slot >= 0:  # A[slot] [W, in] . x[token] [in]
        acc = _rows_dot(a_ptr + slot * stride_a_slot, x_ptr + token * stride_x_row, ws, w_mask, in_features,
                        BLOCK_W_SHRINK, BLOCK_K)  # fmt: skip
    tl.store(xa_ptr + token * lora_width + ws, acc, mask=w_mask)


@triton.jit
def lora_expand_kernel(
    xa_ptr, b_ptr, slots_ptr, y_ptr,
    out_features, lora_width, stride_y_row, stride_b_slot,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        n_mask = ns < out_features
        # B[slot] [out, W] . xa[token] [W]
        acc = _rows_dot(b_ptr + slot * stride_b_slot, xa_ptr + token * lora_width, ns, n_mask, lora_width,
                        BLOCK_N, BLOCK_W)  # fmt: skip
        y_tile = y_ptr + token * stride_y_row + ns
        y = tl.load(y_tile, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_tile, (y + acc).to(y_ptr.dtype.element_ty), mask=n_mask)


def shrink_constants(lora_width: int) -> dict:
    """Constants (and num_warps) of lora_shrink_kernel: the rank tile covers up to 64 columns."""
    return dict(BLOCK_W_SHRINK=min(max(triton.next_power_of_2(lora_width), 16), 64), BLOCK_K=BLOCK_K, num_warps=4)


def expand_constants() -> dict:
    return dict(BLOCK_N=BLOCK_N, BLOCK_W=BLOCK_W, num_warps=4)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, out] += each token's (x A[s]^T) B[s]^T, in place; x [T, in], a [slots, W, in] and
    b [slots, out, W] contiguous, token_slots [T] int32."""
    if x.dim() == 2 and x.stride(1) != 1:
        x = x.contiguous()
    num_tokens, in_features = x.shape
    num_slots, width, a_in = a.shape
    out_features = y.shape[1]
    if (
        a_in != in_features or tuple(b.shape) != (num_slots, out_features, width) or token_slots.shape != (num_tokens,)
        or y.shape[0] != num_tokens or y.stride(1) != 1
        or not (a.is_contiguous() and b.is_contiguous()) or token_slots.dtype != torch.int32
    ):  # fmt: skip
        raise ValueError(
            f"LoRA kernel: x {list(x.shape)}, a {list(a.shape)}, b {list(b.shape)}, y {list(y.shape)}, "
            f"slots {list(token_slots.shape)} {token_slots.dtype} do not fit"
        )
    if num_tokens == 0:
        return y
    xa = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)  # [T, W]
    shrink = shrink_constants(width)
    grid = (num_tokens, triton.cdiv(width, shrink["BLOCK_W_SHRINK"]))
    lora_shrink_kernel[grid](x, a, token_slots, xa, in_features, width, x.stride(0), a.stride(0), **shrink)
    grid = (num_tokens, triton.cdiv(out_features, BLOCK_N))
    lora_expand_kernel[grid](xa, b, token_slots, y, out_features, width, y.stride(0), b.stride(0), **expand_constants())
    return y
