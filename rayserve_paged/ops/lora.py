"""The LoRA contribution of a batch whose rows use different adapters (or none), without
merging any adapter into the base weight (the punica / S-LoRA idea).

One layer holds every slot's adapter, padded to the pool's rank width W:

    a [num_slots, W, in]     A of each slot (rows past the adapter's rank are zero)
    b [num_slots, out, W]    B of each slot, lora_alpha / r folded in (columns past r zero)

    y[t] += (x[t] A[s]^T) B[s]^T     for every token t whose row runs the adapter in slot s
                                     (s = -1: the base model, nothing added)

`add_lora_segments` is the CPU path: the step's tokens grouped by slot once per step
(`lora_segments`), then per layer two GEMMs per adapter in the batch. `lora_reference` is
the per-token definition the kernels (ops/triton_lora.py) are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# (slot, token indices [n] int64, or None for every token of the step)
Segments = list[tuple[int, torch.Tensor | None]]


def lora_segments(token_slots: list[int], device: torch.device | str) -> Segments:
    """The step's tokens grouped by adapter slot, base-model tokens (-1) left out."""
    first = token_slots[0]
    if all(s == first for s in token_slots):
        return [] if first < 0 else [(first, None)]
    by_slot: dict[int, list[int]] = {}
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(t)
    return [(slot, torch.tensor(index, dtype=torch.long, device=device)) for slot, index in by_slot.items()]


def add_lora_segments(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: Segments) -> torch.Tensor:
    """y [T, out] += each segment's (x A^T) B^T, in place; x [T, in]."""
    for slot, index in segments:
        if index is None:
            y += F.linear(F.linear(x, a[slot]), b[slot])  # [T, W] -> [T, out]
        else:
            y.index_add_(0, index, F.linear(F.linear(x.index_select(0, index), a[slot]), b[slot]))
    return y


def lora_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """The LoRA contribution [T, out] token by token, in float32 (the kernels' reference)."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] = b[slot].float() @ (a[slot].float() @ x[t].float())
    return out
