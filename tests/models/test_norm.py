"""RMSNorm's one-op CPU path gives the formula's values bit for bit."""

from __future__ import annotations

import pytest
import torch

from rayserve_paged.models.layers import RMSNorm


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, size", [(1, 576), (3, 64), (32, 960), (7, 4096)])
def test_cpu_float32_norm_equals_the_formula_bit_for_bit(rows, size, threads):
    generator = torch.Generator().manual_seed(rows * size)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        norm = RMSNorm(size, 1e-5)
        norm.weight.data = torch.randn(size, generator=generator)
        for magnitude in (1e-3, 1.0, 1e3):
            x = torch.randn(rows, size, generator=generator) * magnitude
            residual = torch.randn(rows, size, generator=generator)
            assert torch.equal(norm(x), norm._norm_formula(x))
            y, summed = norm(x, residual)
            assert torch.equal(summed, x + residual) and torch.equal(y, norm._norm_formula(x + residual))
    finally:
        torch.set_num_threads(previous)


def test_other_dtypes_and_the_gemma_offset_take_the_formula(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "rms_norm", lambda *a, **k: calls.append(a) or pytest.fail("fused path taken"))
    x = torch.randn(2, 8)
    gemma = RMSNorm(8, 1e-6, weight_offset=1.0)
    assert torch.equal(gemma(x), (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + gemma.weight))
    half = RMSNorm(8, 1e-6, dtype=torch.bfloat16)
    assert half(x.bfloat16()).dtype == torch.bfloat16
    assert calls == []
