"""The compiled CPU decoder layer (ops/cpu_layer.py) against the layer written out in torch with
the dequantized float32 weights: RMSNorm, q|k|v (+ bias), rotate-half RoPE, the cache write at
each token's slot, paged decode attention (grouped-query heads, sliding window, soft-cap), o,
the residual adds, SwiGLU. x and residual within float32 summation-order tolerance; the caches
hold the rotated keys and the values at exactly the step's slots and are unchanged elsewhere;
bad slots and block ids are refused by name before anything is written."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rayserve_paged.ops import cpu_decode, cpu_layer, quant_cpu

from .builders import group_quantized

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason="needs a C++ compiler")

HIDDEN, INTER, D = 64, 96, 16
BLOCK_SIZE, NUM_BLOCKS = 4, 24


def _world(seed: int, *, bits: int, num_heads: int, num_kv_heads: int, bias: bool, seq_lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    shapes = {"qkv": ((num_heads + 2 * num_kv_heads) * D, HIDDEN), "o": (HIDDEN, num_heads * D),
              "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}  # fmt: skip
    weights = {}
    for i, (name, (rows, cols)) in enumerate(shapes.items()):
        codes, scales, offsets, dense = group_quantized(rows, cols, bits, 32, seed * 10 + i)
        b = torch.randn(rows, generator=g) * 0.1 if bias else None
        weights[name] = (quant_cpu.pack(codes, scales, offsets, bits), b, dense)
    norms = [1 + 0.1 * torch.randn(HIDDEN, generator=g) for _ in range(2)]
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, D)
    caches = [torch.randn(shape, generator=g), torch.randn(shape, generator=g)]
    blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, slots = [], []
    for n in seq_lens:  # each sequence's distinct blocks; its new token at position n - 1
        used = -(-n // BLOCK_SIZE)
        tables.append([blocks.pop() for _ in range(used)])
        slots.append(tables[-1][(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    positions = torch.tensor(seq_lens) - 1
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)  # [T, D]
    return weights, norms, caches, block_tables, torch.tensor(slots), torch.tensor(seq_lens, dtype=torch.int32), angles


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, cos, sin):  # x [T, H, D]
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


def _reference(weights, norms, caches, tables, slots, seq_lens, angles, x, residual, *, is_first, num_heads,
               num_kv_heads, scale, window, soft_cap, eps=1e-5):  # fmt: skip
    """The layer in torch, float32 dequantized weights; returns (x, residual, key cache, value cache)."""
    key_cache, value_cache = caches[0].clone(), caches[1].clone()
    linear = {n: (lambda h, w=w: F.linear(h, w[2], w[1])) for n, w in weights.items()}
    residual = x.clone() if is_first else residual + x
    qkv = linear["qkv"](_rms(residual, norms[0], eps))
    T = x.shape[0]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    q = _rope(q.view(T, num_heads, D), cos, sin)
    k = _rope(k.reshape(T, num_kv_heads, D), cos, sin)
    flat_k, flat_v = key_cache.view(-1, num_kv_heads, D), value_cache.view(-1, num_kv_heads, D)
    flat_k[slots], flat_v[slots] = k, v.reshape(T, num_kv_heads, D)
    out = torch.empty(T, num_heads, D)
    group = num_heads // num_kv_heads
    for t in range(T):
        n = int(seq_lens[t])
        first = max(0, n - window) if window else 0
        rows = torch.tensor([int(tables[t, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(first, n)])
        keys, values = flat_k[rows].repeat_interleave(group, 1), flat_v[rows].repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", q[t], keys) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        out[t] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
    residual = residual + linear["o"](out.reshape(T, -1))
    gate, up = linear["gate_up"](_rms(residual, norms[1], eps)).chunk(2, dim=-1)
    return linear["down"](F.silu(gate) * up), residual, key_cache, value_cache


CASES = {
    "one sequence, 4-bit": dict(bits=4, num_heads=4, num_kv_heads=2, bias=False, seq_lens=[7], window=None, soft_cap=None),
    "three, 8-bit, biases": dict(bits=8, num_heads=4, num_kv_heads=4, bias=True, seq_lens=[1, 9, 16],
                                 window=None, soft_cap=None),
    "window and soft-cap": dict(bits=4, num_heads=6, num_kv_heads=2, bias=True, seq_lens=[13, 5, 21, 2],
                                window=6, soft_cap=20.0),
}  # fmt: skip


@pytest.mark.parametrize("is_first", [True, False], ids=["first layer", "later layer"])
@pytest.mark.parametrize("case", CASES)
def test_layer_equals_the_torch_layer_of_its_dequantized_weights(case, is_first):
    kernel = cpu_layer.load()
    assert kernel is not None
    c = CASES[case]
    num_heads, num_kv_heads = c["num_heads"], c["num_kv_heads"]
    weights, norms, caches, tables, slots, seq_lens, angles = _world(
        3, bits=c["bits"], num_heads=num_heads, num_kv_heads=num_kv_heads, bias=c["bias"], seq_lens=c["seq_lens"]
    )
    T = len(c["seq_lens"])
    g = torch.Generator().manual_seed(7)
    x, residual = torch.randn(T, HIDDEN, generator=g), torch.randn(T, HIDDEN, generator=g)
    scale = 1 / math.sqrt(D)
    want = _reference(weights, norms, caches, tables, slots, seq_lens, angles, x, residual, is_first=is_first,
                      num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale, window=c["window"],
                      soft_cap=c["soft_cap"])  # fmt: skip
    key_cache, value_cache = caches[0].clone(), caches[1].clone()
    layer = cpu_layer.decode_layer(
        input_norm=norms[0], post_norm=norms[1], eps=1e-5, **{n: w[:2] for n, w in weights.items()},
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=D, scale=scale, sliding_window=c["window"],
        soft_cap=c["soft_cap"], key_cache=key_cache, value_cache=value_cache,
    )  # fmt: skip
    step = cpu_layer.decode_step(HIDDEN, angles.cos(), angles.sin(), slots, tables, seq_lens)
    got_x, got_residual = x.clone(), residual.clone()
    kernel(layer, step, got_x, got_residual, is_first=is_first)
    for got, expected in ((got_x, want[0]), (got_residual, want[1])):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[slots] = True
    for got, expected, before in ((key_cache, want[2], caches[0]), (value_cache, want[3], caches[1])):
        flat, flat_expected, flat_before = (t.view(NUM_BLOCKS * BLOCK_SIZE, -1) for t in (got, expected, before))
        assert torch.equal(flat[~written], flat_before[~written])  # nothing but the step's slots
        torch.testing.assert_close(flat[written], flat_expected[written], rtol=1e-4, atol=1e-5)


def test_bad_slots_and_block_ids_are_refused_by_name_before_any_write():
    kernel = cpu_layer.load()
    c = CASES["one sequence, 4-bit"]
    weights, norms, caches, tables, slots, seq_lens, angles = _world(
        5, bits=4, num_heads=4, num_kv_heads=2, bias=False, seq_lens=[6, 3]
    )
    key_cache, value_cache = caches[0].clone(), caches[1].clone()
    layer = cpu_layer.decode_layer(
        input_norm=norms[0], post_norm=norms[1], eps=1e-5, **{n: w[:2] for n, w in weights.items()},
        num_heads=c["num_heads"], num_kv_heads=c["num_kv_heads"], head_dim=D, scale=0.25, sliding_window=None,
        soft_cap=None, key_cache=key_cache, value_cache=value_cache,
    )  # fmt: skip
    with pytest.raises(ValueError, match="block size must be >= 1"):  # a division by zero in the C code
        empty = key_cache[:, :0].contiguous()
        cpu_layer.decode_layer(
            input_norm=norms[0], post_norm=norms[1], eps=1e-5, **{n: w[:2] for n, w in weights.items()},
            num_heads=c["num_heads"], num_kv_heads=c["num_kv_heads"], head_dim=D, scale=0.25, sliding_window=None,
            soft_cap=None, key_cache=empty, value_cache=empty,
        )  # fmt: skip
    x, residual = torch.zeros(2, HIDDEN), torch.zeros(2, HIDDEN)
    bad_slots = slots.clone()
    bad_slots[1] = NUM_BLOCKS * BLOCK_SIZE
    step = cpu_layer.decode_step(HIDDEN, angles.cos(), angles.sin(), bad_slots, tables, seq_lens)
    with pytest.raises(ValueError, match=rf"slot_mapping\[1\]={NUM_BLOCKS * BLOCK_SIZE} is outside"):
        kernel(layer, step, x, residual, is_first=True)
    assert torch.equal(key_cache, caches[0]) and torch.equal(value_cache, caches[1])
    bad_tables = tables.clone()
    bad_tables[0, 1] = NUM_BLOCKS
    step = cpu_layer.decode_step(HIDDEN, angles.cos(), angles.sin(), slots, bad_tables, seq_lens)
    with pytest.raises(ValueError, match=rf"block_tables\[0, 1\]={NUM_BLOCKS} is outside"):
        kernel(layer, step, x, residual, is_first=True)
    with pytest.raises(ValueError, match="x .* and residual .* must be contiguous"):
        kernel(layer, step, torch.zeros(3, HIDDEN), torch.zeros(3, HIDDEN), is_first=True)
    with pytest.raises(ValueError, match="qkv is"):
        cpu_layer.decode_layer(
            input_norm=norms[0], post_norm=norms[1], eps=1e-5, **{n: w[:2] for n, w in weights.items()},
            num_heads=2, num_kv_heads=2, head_dim=D, scale=0.25, sliding_window=None, soft_cap=None,
            key_cache=caches[0][..., :2, :].contiguous(), value_cache=caches[1][..., :2, :].contiguous(),
        )  # fmt: skip
