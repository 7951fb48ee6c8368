"""The LoRA kernels against the per-token torch reference (ops/lora.py), on random pools and
slot maps mixing adapters and base-model tokens (CPU: under the Triton interpreter)."""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("RAYSERVE_PAGED_TRITON_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from rayserve_paged.ops import triton_lora  # noqa: E402
from rayserve_paged.ops.lora import add_lora_segments, lora_reference, lora_segments  # noqa: E402


def _pool(num_slots, width, in_features, out_features, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots, width, in_features, generator=g), torch.randn(num_slots, out_features, width, generator=g)


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.float32, marks=pytest.mark.quick), torch.float16, torch.bfloat16],
)
@pytest.mark.parametrize(
    "slots, width, in_features, out_features",
    [
        ([0, -1, 1, 1, 0, -1, 2], 16, 64, 96),  # mixed, base rows between
        ([1], 8, 40, 24),  # one decode row; tiles wider than the shapes
        ([2, 2, 2, 2], 48, 130, 70),  # one adapter, a fused layer's three rank blocks; ragged tiles
        ([-1, -1], 16, 64, 64),  # base only: y unchanged
    ],
)
def test_kernel_equals_the_reference(slots, width, in_features, out_features, dtype):
    a, b = _pool(3, width, in_features, out_features, len(slots))
    x = torch.randn(len(slots), in_features, generator=torch.Generator().manual_seed(3))
    y0 = torch.randn(len(slots), out_features, generator=torch.Generator().manual_seed(4))
    token_slots = torch.tensor(slots, dtype=torch.int32)
    want = y0 + lora_reference(x, a, b, token_slots)
    args = [t.to(dtype).to(DEVICE) for t in (y0, x, a, b)]
    got = triton_lora.lora_add(*args, token_slots.to(DEVICE)).cpu()
    assert got.dtype == dtype
    scale = (x.abs() @ a.abs().transpose(1, 2)).amax() * b.abs().sum(-1).amax() + y0.abs().amax()
    bound = {torch.float32: 1e-5, torch.float16: 2**-8, torch.bfloat16: 2**-5}[dtype] * float(scale)
    assert (got.float() - want).abs().max() <= bound
    if all(s < 0 for s in slots):
        assert torch.equal(got, args[0].cpu())


def test_segments_equal_the_reference():
    a, b = _pool(3, 16, 32, 24, 0)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    slots = [2, -1, 0, 2, 2, -1]
    y = add_lora_segments(torch.zeros(6, 24), x, a, b, lora_segments(slots, "cpu"))
    torch.testing.assert_close(y, lora_reference(x, a, b, torch.tensor(slots)), atol=1e-4, rtol=1e-5)
    assert lora_segments([-1, -1], "cpu") == [] and lora_segments([1, 1], "cpu") == [(1, None)]


def test_bad_shapes_are_refused_before_launch():
    a, b = _pool(2, 16, 32, 24, 0)
    with pytest.raises(ValueError, match=r"x \[3, 30\], a \[2, 16, 32\]"):
        triton_lora.lora_add(torch.zeros(3, 24), torch.zeros(3, 30), a, b, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="torch.int64 do not fit"):
        triton_lora.lora_add(torch.zeros(3, 24), torch.zeros(3, 32), a, b, torch.zeros(3, dtype=torch.int64))


def test_the_layers_batch_takes_the_kernel_with_device_slots():
    """LoRABatch as a CUDA step sets it up (token slots [T] int32 on the device): a layer's
    apply goes through the kernels and equals the CPU path's segments."""
    from rayserve_paged.models.lora import LoRABatch

    a, b = _pool(2, 8, 32, 16, 5)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))[:, ::2]  # non-unit stride
    slots = [1, 0, -1, 1, 1]
    on_cpu = LoRABatch()
    on_cpu.set_step(slots, "cpu")
    assert on_cpu.is_active and on_cpu.token_slots is None
    want = on_cpu.apply(torch.zeros(5, 16), x, a, b)
    kernel = LoRABatch()
    kernel.is_active, kernel.token_slots = True, torch.tensor(slots, dtype=torch.int32).to(DEVICE)
    got = kernel.apply(torch.zeros(5, 16, device=DEVICE), x.to(DEVICE), a.to(DEVICE), b.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    kernel.clear()
    assert not kernel.is_active and kernel.token_slots is None
