"""Sliding-window attention and attention logit soft-capping against a dense float64
reference, in the torch reference (its torch decode path and the compiled CPU decode kernel):
GQA 1, 4 and 8, block sizes 8 / 16 / 32, windows smaller and larger than a block; fresh
prefills, prefills over cached context (chunks) and decodes in one step.

The blocks that lie wholly before every query's window are poisoned with NaN after the
context is written: a path that reads one (a block the scheduler may have freed) fails.
"""

from __future__ import annotations

import pytest
import torch

from rayserve_paged.ops import TorchReferenceBackend, cpu_decode

from .builders import make_attention_inputs, make_metadata

PATHS = {"cpu_kernel": True, "torch_path": False}
HEADS = [(4, 4), (8, 2), (8, 1)]  # GQA group sizes 1, 4, 8
# prefills (context_len, new tokens) and decodes (context_len), across and inside windows
CASE = dict(prefills=[(0, 30), (21, 6), (3, 2)], decodes=[0, 4, 37, 70])


def dense_windowed_attention(inputs, batch, scale, window, soft_cap) -> torch.Tensor:
    """Each new token at position p over keys p - window < k <= p of its sequence, float64."""
    num_tokens, num_heads, head_dim = inputs.query.shape
    group_size = num_heads // inputs.key_history[0].shape[1]
    output = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    start = 0
    for i, (context_len, query_len) in enumerate(zip(batch.context_lens, batch.query_lens)):
        query = inputs.query[start : start + query_len].double().cpu()  # [q, heads, d]
        keys = inputs.key_history[i].double().cpu().repeat_interleave(group_size, dim=1)  # [seq, heads, d]
        values = inputs.value_history[i].double().cpu().repeat_interleave(group_size, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale  # [heads, q, seq]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        key_pos = torch.arange(keys.shape[0])[None, :]
        query_pos = (context_len + torch.arange(query_len))[:, None]
        is_visible = (key_pos <= query_pos) & (key_pos > query_pos - window)
        probs = scores.masked_fill(~is_visible, float("-inf")).softmax(dim=-1)
        output[start : start + query_len] = torch.einsum("hqk,khd->qhd", probs, values)
        start += query_len
    return output


def poison_blocks_before_windows(inputs, batch, window) -> int:
    """NaN into every cached block whose positions all precede the window of the sequence's
    first new token; returns how many."""
    poisoned = 0
    for table, context_len in zip(batch.block_tables, batch.context_lens):
        oldest_visible = context_len + 1 - window
        for b, block in enumerate(table):
            if (b + 1) * batch.block_size <= oldest_visible:
                inputs.key_cache[block] = float("nan")
                inputs.value_cache[block] = float("nan")
                poisoned += 1
    return poisoned


@pytest.mark.parametrize("soft_cap", [None, 1.5], ids=["no_cap", "cap"])
@pytest.mark.parametrize("window", [5, 20], ids=["window5", "window20"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}_kv{h[1]}")
@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
def test_windowed_soft_capped_attention_matches_dense(path, heads, block_size, window, soft_cap, generator):
    batch = make_metadata(**CASE, block_size=block_size, generator=generator, num_pad_tokens=1)
    num_heads, num_kv_heads = heads
    inputs = make_attention_inputs(
        batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, generator=generator
    )
    scale = 16**-0.5 * 4  # large scores, so the cap bends them
    expected = dense_windowed_attention(inputs, batch, scale, window, soft_cap)
    num_poisoned = poison_blocks_before_windows(inputs, batch, window)
    assert num_poisoned > 0
    backend = TorchReferenceBackend(use_cpu_kernel=path)
    output = backend.forward(
        inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, batch.metadata, scale,
        sliding_window=window, soft_cap=soft_cap,
    )  # fmt: skip
    num_real = batch.num_real_tokens
    torch.testing.assert_close(output[:num_real], expected[:num_real].float(), atol=1e-5, rtol=1e-5)
    assert not output[num_real:].any()
    assert (backend._kernel is not None) == (path and cpu_decode.load() is not None)


def test_a_window_wider_than_the_context_equals_full_attention(generator):
    batch = make_metadata(**CASE, block_size=16, generator=generator)
    inputs = make_attention_inputs(batch, num_heads=8, num_kv_heads=2, head_dim=16, generator=generator)
    backend = TorchReferenceBackend()
    args = (inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, batch.metadata, 0.25)
    torch.testing.assert_close(backend.forward(*args, sliding_window=1000), backend.forward(*args), atol=1e-6, rtol=0)
