"""The torch reference ops against plain dense computations, on random inputs of several shapes.

Caches start poisoned with NaN wherever nothing was written, so a backend that reads a slot
it should not (or before writing it) fails loudly.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rayserve_paged.ops import (
    PAD_SLOT,
    TorchReferenceBackend,
    copy_blocks,
    get_attention_backend,
    reshape_and_cache,
    swap_blocks,
    swap_kv_blocks,
)
from rayserve_paged.ops.cache_ops import contiguous_runs

from .builders import counted, make_attention_inputs, make_metadata, new_token_slots

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def randn(generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype)


# ---------------------------------------------------------------------------- dense reference


def dense_attention(inputs, batch, scale: float) -> torch.Tensor:
    """Full causal attention over each sequence's whole K/V history, float64, GQA by repeat."""
    num_tokens, num_heads, head_dim = inputs.query.shape
    group_size = num_heads // inputs.key_history[0].shape[1]
    output = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)  # [num_tokens, heads, d]
    start = 0
    for i, (context_len, query_len) in enumerate(zip(batch.context_lens, batch.query_lens)):
        query = inputs.query[start : start + query_len].double().cpu()  # [query_len, heads, d]
        # [seq_len, num_heads, head_dim]
        keys = inputs.key_history[i].double().cpu().repeat_interleave(group_size, dim=1)
        values = inputs.value_history[i].double().cpu().repeat_interleave(group_size, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale  # [heads, query_len, seq_len]
        positions = torch.arange(keys.shape[0])
        is_visible = positions[None, :] <= (context_len + torch.arange(query_len))[:, None]
        probs = scores.masked_fill(~is_visible, float("-inf")).softmax(dim=-1)
        output[start : start + query_len] = torch.einsum("hqk,khd->qhd", probs, values)
        start += query_len
    return output


def expected_caches(inputs, batch):
    """The caches as they must be after the step: new tokens' K/V in their slots, rest untouched."""
    slots = torch.tensor(new_token_slots(batch), dtype=torch.int64)
    num_real = batch.num_real_tokens
    caches = []
    for cache, new in ((inputs.key_cache, inputs.key), (inputs.value_cache, inputs.value)):
        expected = cache.clone()
        expected.view(-1, *cache.shape[2:])[slots] = new[:num_real]
        caches.append(expected)
    return caches


# ---------------------------------------------------------------------------- attention


CASES = {
    "prefill_fresh": dict(prefills=[(0, 5), (0, 17), (0, 1)]),
    "prefill_cached_context": dict(prefills=[(16, 3), (7, 20), (33, 1)]),
    "decode": dict(decodes=[0, 5, 31, 40]),
    "mixed": dict(prefills=[(0, 9), (12, 4)], decodes=[3, 17, 64]),
    "mixed_padded": dict(prefills=[(5, 6)], decodes=[8, 0], num_pad_tokens=3),
}
HEADS = [(4, 4), (4, 2), (8, 2)]  # (num_heads, num_kv_heads): GQA ratios 1, 2, 4


def run_case(case, generator, *, block_size=16, head_dim=64, heads=(8, 2), dtype=torch.float32, backend=None,
             strided_kv=False, **kw):
    batch = make_metadata(**case, block_size=block_size, generator=generator, **kw)
    num_heads, num_kv_heads = heads
    inputs = make_attention_inputs(
        batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        generator=generator, dtype=dtype,
    )
    caches_after = expected_caches(inputs, batch)
    scale = head_dim**-0.5
    key, value = inputs.key, inputs.value
    if strided_kv:  # as the models pass them: views into one fused qkv projection
        qkv = torch.cat((inputs.query, key, value), dim=1)  # [num_tokens, heads + 2 * kv_heads, d]
        key, value = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    backend = backend if backend is not None else TorchReferenceBackend()
    output = backend.forward(inputs.query, key, value, inputs.key_cache, inputs.value_cache, batch.metadata, scale)
    return batch, inputs, output, dense_attention(inputs, batch, scale), caches_after


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"heads{h[0]}_kv{h[1]}")
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_attention_matches_dense_float32(case, block_size, head_dim, heads, generator):
    batch, inputs, output, expected, caches_after = run_case(
        case, generator, block_size=block_size, head_dim=head_dim, heads=heads
    )
    assert output.shape == inputs.query.shape and output.dtype == torch.float32
    num_real = batch.num_real_tokens
    torch.testing.assert_close(output[:num_real], expected[:num_real].float(), atol=1e-5, rtol=1e-5)
    assert torch.equal(output[num_real:], torch.zeros_like(output[num_real:]))  # padding rows
    torch.testing.assert_close(inputs.key_cache, caches_after[0], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(inputs.value_cache, caches_after[1], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float16, 1e-3), (torch.bfloat16, 8e-3)], ids=["float16", "bfloat16"]
)
@pytest.mark.parametrize(
    "case", [CASES["mixed_padded"], CASES["prefill_cached_context"]], ids=["mixed", "context"]
)
def test_attention_matches_dense_half_precision(case, dtype, tolerance, generator):
    batch, inputs, output, expected, _ = run_case(case, generator, dtype=dtype)
    assert output.dtype == dtype
    num_real = batch.num_real_tokens
    torch.testing.assert_close(
        output[:num_real].double(), expected[:num_real], atol=tolerance, rtol=tolerance
    )
    assert not output[num_real:].any()


def test_attention_without_host_lists_matches_dense(generator):
    batch, _, output, expected, _ = run_case(CASES["mixed_padded"], generator, with_host_lists=False)
    assert batch.metadata.prefill_seq_lens_host is None
    num_real = batch.num_real_tokens
    torch.testing.assert_close(output[:num_real], expected[:num_real].float(), atol=1e-5, rtol=1e-5)


def test_decode_of_first_token_returns_its_own_value(generator):
    """seq_len 1: the only key is the one written this step, so every head returns its kv head's value."""
    batch, inputs, output, _, _ = run_case(dict(decodes=[0]), generator, heads=(4, 2))
    expected = inputs.value[0].repeat_interleave(2, dim=0)  # [num_heads, head_dim]
    torch.testing.assert_close(output[0], expected, atol=1e-6, rtol=0)


@settings(max_examples=25, deadline=None)
@given(
    prefills=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), max_size=3),
    decodes=st.lists(st.integers(0, 50), max_size=4),
    num_pad_tokens=st.integers(0, 2),
    block_size=st.sampled_from([8, 16, 32]),
    heads=st.sampled_from(HEADS),
    seed=st.integers(0, 2**31 - 1),
)
def test_attention_random_batches_match_dense(prefills, decodes, num_pad_tokens, block_size, heads, seed):
    if not prefills and not decodes:
        decodes = [seed % 7]
    generator = torch.Generator().manual_seed(seed)
    case = dict(prefills=prefills, decodes=decodes, num_pad_tokens=num_pad_tokens)
    batch, _, output, expected, _ = run_case(case, generator, block_size=block_size, head_dim=16, heads=heads)
    num_real = batch.num_real_tokens
    torch.testing.assert_close(output[:num_real], expected[:num_real].float(), atol=1e-5, rtol=1e-5)
    assert not output[num_real:].any()


# ---------------------------------------------------------------------------- attention input checks


def _forward_with(generator, change):
    """Build a valid mixed batch, apply change(inputs, metadata) -> (inputs, metadata), run forward."""
    batch = make_metadata(**CASES["mixed"], block_size=16, generator=generator)
    inputs = make_attention_inputs(batch, num_heads=4, num_kv_heads=2, head_dim=16, generator=generator)
    inputs, metadata = change(inputs, batch.metadata)
    TorchReferenceBackend().forward(
        inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, metadata, 0.25
    )


BAD_FORWARDS = {
    "heads not a multiple": (
        lambda i, m: (dataclasses.replace(i, query=i.query[:, :3]), m), "num_heads=3 is not a multiple"
    ),
    "query dtype": (
        lambda i, m: (dataclasses.replace(i, query=i.query.double()), m), "query dtype torch.float64"
    ),
    "token count": (
        lambda i, m: (dataclasses.replace(i, key=i.key[:-1], value=i.value[:-1]), m), "does not match query"
    ),
    "block size": (lambda i, m: (i, dataclasses.replace(m, block_size=32)), "block_size=32 != key_cache"),
    "block size too small for the tables": (
        lambda i, m: (i, dataclasses.replace(m, block_size=8)), "does not fit prefill_block_tables of 1 blocks x 8"
    ),
    "narrow block table": (
        lambda i, m: (i, dataclasses.replace(m, max_decode_seq_len=200)),
        "max_decode_seq_len=200 does not fit",
    ),
    "slot dtype": (
        lambda i, m: (i, dataclasses.replace(m, slot_mapping=m.slot_mapping.int())),
        "slot_mapping must be int64",
    ),
    "table dtype": (
        lambda i, m: (i, dataclasses.replace(m, decode_block_tables=m.decode_block_tables.float())),
        "decode_block_tables must be int32 or int64",
    ),
    "decode count": (
        lambda i, m: (i, dataclasses.replace(m, num_decode_tokens=2)), "num_decode_tokens=2 != len",
    ),
    "host query lens": (
        lambda i, m: (i, dataclasses.replace(m, prefill_query_lens_host=[9, 5])), "sums to 14",
    ),
}


@pytest.mark.parametrize("change, message", BAD_FORWARDS.values(), ids=BAD_FORWARDS.keys())
def test_forward_rejects_bad_inputs(change, message, generator):
    with pytest.raises(ValueError, match=message):
        _forward_with(generator, change)


# ---------------------------------------------------------------------------- reshape_and_cache


def test_reshape_and_cache_writes_slots_and_skips_pad(generator):
    key_cache = torch.full((6, 4, 2, 3), float("nan"))  # [num_blocks, block_size, kv_heads, d]
    value_cache = torch.full((6, 4, 2, 3), float("nan"))
    key = randn(generator, 5, 2, 3)  # [num_tokens, kv_heads, d]
    value = randn(generator, 5, 2, 3)
    slots = [3, PAD_SLOT, 17, 0, PAD_SLOT]
    reshape_and_cache(key, value, key_cache, value_cache, torch.tensor(slots))
    for cache, new in ((key_cache, key), (value_cache, value)):
        expected = torch.full((6, 4, 2, 3), float("nan"))
        for token, slot in enumerate(slots):
            if slot != PAD_SLOT:
                expected[slot // 4, slot % 4] = new[token]
        torch.testing.assert_close(cache, expected, atol=0, rtol=0, equal_nan=True)
    assert int(torch.isnan(key_cache).sum()) == (24 - 3) * 6


def _cache_args(generator):
    return dict(
        key=randn(generator, 3, 2, 4), value=randn(generator, 3, 2, 4),  # [num_tokens, kv_heads, d]
        key_cache=torch.zeros(5, 8, 2, 4), value_cache=torch.zeros(5, 8, 2, 4),
        slot_mapping=torch.tensor([1, 9, PAD_SLOT]),
    )


BAD_CACHE_ARGS = {
    "key dims": (dict(key=torch.zeros(3, 8)), "key must be"),
    "value shape": (dict(value=torch.zeros(3, 1, 4)), "value shape"),
    "head_dim": (dict(key=torch.zeros(3, 2, 5), value=torch.zeros(3, 2, 5)), "does not fit key_cache"),
    "cache shapes": (dict(value_cache=torch.zeros(4, 8, 2, 4)), "value_cache shape"),
    "slot count": (dict(slot_mapping=torch.tensor([1, 2])), r"slot_mapping must be \[num_tokens=3\]"),
    "slot dtype": (dict(slot_mapping=torch.tensor([1, 2, 3], dtype=torch.int32)), "must be int64"),
    "key dtype": (dict(key=torch.zeros(3, 2, 4, dtype=torch.float16)), "dtype"),
    "cache dtype": (
        dict(key_cache=torch.zeros(5, 8, 2, 4).half(), value_cache=torch.zeros(5, 8, 2, 4).half()),
        "key_cache dtype",
    ),
    "non-contiguous cache": (dict(key_cache=torch.zeros(8, 5, 2, 4).transpose(0, 1)), "contiguous"),
}


@pytest.mark.parametrize("override, message", BAD_CACHE_ARGS.values(), ids=BAD_CACHE_ARGS.keys())
def test_reshape_and_cache_rejects_bad_inputs(override, message, generator):
    args = _cache_args(generator) | override
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**args)


# ---------------------------------------------------------------------------- copy_blocks


def random_layers(generator, num_layers=2, num_blocks=8):
    return [
        (randn(generator, num_blocks, 4, 2, 3), randn(generator, num_blocks, 4, 2, 3))  # [blocks, bs, kv, d]
        for _ in range(num_layers)
    ]


def apply_pairs(cache: torch.Tensor, src_cache: torch.Tensor, pairs) -> torch.Tensor:
    expected = cache.clone()
    for src, dst in pairs:
        expected[dst] = src_cache[src]
    return expected


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_copy_blocks_copies_whole_blocks_in_every_layer(as_tensor, generator):
    layers = random_layers(generator)
    before = [(k.clone(), v.clone()) for k, v in layers]
    pairs = [(1, 5), (3, 2), (1, 7)]
    copy_blocks(layers, torch.tensor(pairs) if as_tensor else pairs)
    for (key, value), (key_before, value_before) in zip(layers, before):
        assert torch.equal(key, apply_pairs(key_before, key_before, pairs))
        assert torch.equal(value, apply_pairs(value_before, value_before, pairs))


def test_copy_blocks_reads_every_source_before_writing(generator):
    layers = random_layers(generator, num_layers=1)
    key_before = layers[0][0].clone()
    copy_blocks(layers, [(0, 1), (1, 0)])
    assert torch.equal(layers[0][0][0], key_before[1]) and torch.equal(layers[0][0][1], key_before[0])
    assert torch.equal(layers[0][0][2:], key_before[2:])


def test_copy_blocks_with_empty_mapping_changes_nothing(generator):
    layers = random_layers(generator)
    before = [(k.clone(), v.clone()) for k, v in layers]
    copy_blocks(layers, [])
    copy_blocks(layers, torch.zeros(0, 2, dtype=torch.int64))
    assert all(torch.equal(k, kb) and torch.equal(v, vb) for (k, v), (kb, vb) in zip(layers, before))


BAD_COPIES = {
    "source range": (lambda g: random_layers(g), [(8, 1)], r"source block 8 is outside \[0, 8\)"),
    "destination range": (lambda g: random_layers(g), [(0, -1)], r"destination block -1"),
    "repeated destination": (lambda g: random_layers(g), [(0, 3), (1, 3)], "repeated destination"),
    "pair shape": (lambda g: random_layers(g), torch.zeros(2, 3, dtype=torch.int64), r"\[num_pairs, 2\]"),
    "mapping dtype": (lambda g: random_layers(g), torch.zeros(2, 2, dtype=torch.int32), "must be int64"),
    "no layers": (lambda g: [], [(0, 1)], "kv_caches is empty"),
    "layer shapes": (
        lambda g: random_layers(g, num_layers=1) + random_layers(g, num_layers=1, num_blocks=9),
        [(0, 1)], "layer 1 cache shape",
    ),
}


@pytest.mark.parametrize("make_layers, mapping, message", BAD_COPIES.values(), ids=BAD_COPIES.keys())
def test_copy_blocks_rejects_bad_inputs(make_layers, mapping, message, generator):
    with pytest.raises(ValueError, match=message):
        copy_blocks(make_layers(generator), mapping)


# ---------------------------------------------------------------------------- swap_blocks


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_swap_blocks_copies_between_pools_of_different_sizes(as_tensor, generator):
    device_pool = randn(generator, 6, 4, 2, 3)  # [num_gpu_blocks, block_size, kv_heads, d]
    host_pool = randn(generator, 10, 4, 2, 3)  # [num_cpu_blocks, block_size, kv_heads, d]
    host_before, device_before = host_pool.clone(), device_pool.clone()
    pairs = [(0, 4), (5, 5), (2, 9), (3, 0)]
    swap_blocks(device_pool, host_pool, torch.tensor(pairs) if as_tensor else pairs)
    assert torch.equal(host_pool, apply_pairs(host_before, device_before, pairs))
    assert torch.equal(device_pool, device_before)


def test_swap_kv_blocks_round_trip_restores_every_layer(generator):
    device_layers = random_layers(generator, num_layers=3, num_blocks=6)
    host_layers = [(torch.zeros(9, 4, 2, 3), torch.zeros(9, 4, 2, 3)) for _ in range(3)]
    before = [(k.clone(), v.clone()) for k, v in device_layers]
    swap_kv_blocks(device_layers, host_layers, [(1, 7), (4, 2)])  # swap out
    for (host_key, host_value), (key, value) in zip(host_layers, before):
        assert torch.equal(host_key[7], key[1]) and torch.equal(host_value[2], value[4])
        assert not host_key[[0, 1, 3, 4, 5, 6, 8]].any()
    for key, value in device_layers:
        key[1], value[4] = float("nan"), float("nan")  # blocks freed and reused meanwhile
    swap_kv_blocks(host_layers, device_layers, [(7, 1), (2, 4)])  # swap in
    assert all(torch.equal(k, kb) and torch.equal(v, vb) for (k, v), (kb, vb) in zip(device_layers, before))


def test_contiguous_runs_splits_destinations_into_consecutive_runs():
    assert contiguous_runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert contiguous_runs([7]) == [(0, 7, 1)]
    assert contiguous_runs([3, 2]) == [(0, 3, 1), (1, 2, 1)]
    assert contiguous_runs([]) == []


BAD_SWAPS = {
    "dtype": (torch.zeros(4, 4, 2, 3), torch.zeros(4, 4, 2, 3).half(), [(0, 0)], "dtype"),
    "block shape": (torch.zeros(4, 4, 2, 3), torch.zeros(4, 8, 2, 3), [(0, 0)], "block shape"),
    "dims": (torch.zeros(4, 4, 6), torch.zeros(4, 4, 2, 3), [(0, 0)], "must both be"),
    "source range": (torch.zeros(4, 4, 2, 3), torch.zeros(9, 4, 2, 3), [(4, 0)], "source block 4"),
    "destination range": (torch.zeros(4, 4, 2, 3), torch.zeros(9, 4, 2, 3), [(0, 9)], "destination block 9"),
}


@pytest.mark.parametrize("src, dst, mapping, message", BAD_SWAPS.values(), ids=BAD_SWAPS.keys())
def test_swap_blocks_rejects_bad_inputs(src, dst, mapping, message):
    with pytest.raises(ValueError, match=message):
        swap_blocks(src, dst, mapping)


def test_swap_kv_blocks_rejects_layer_count_mismatch(generator):
    with pytest.raises(ValueError, match="2 source layers but 1 destination layers"):
        swap_kv_blocks(random_layers(generator), random_layers(generator, num_layers=1), [(0, 0)])


@requires_cuda
def test_swap_blocks_device_to_pinned_host_and_back(generator):
    device_pool = randn(generator, 6, 4, 2, 3).cuda()
    host_pool = torch.zeros(10, 4, 2, 3).pin_memory()
    pairs = [(0, 4), (5, 5), (2, 9), (3, 0)]
    swap_blocks(device_pool, host_pool, pairs)
    torch.cuda.synchronize()
    assert torch.equal(host_pool, apply_pairs(torch.zeros(10, 4, 2, 3), device_pool.cpu(), pairs))
    restored = torch.zeros_like(device_pool)
    swap_blocks(host_pool, restored, [(d, s) for s, d in pairs])
    torch.cuda.synchronize()
    assert torch.equal(restored[[0, 5, 2, 3]], device_pool[[0, 5, 2, 3]])


@requires_cuda
def test_attention_on_cuda_matches_dense(generator):
    batch, _, output, expected, _ = run_case(CASES["mixed_padded"], generator, device="cuda")
    num_real = batch.num_real_tokens
    torch.testing.assert_close(output[:num_real].cpu(), expected[:num_real].float(), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- backend dispatch


@pytest.fixture
def fake_triton(monkeypatch):
    module = types.ModuleType("rayserve_paged.ops.triton_backend")

    class TritonBackend(TorchReferenceBackend):
        name = "triton"

    module.TritonBackend = TritonBackend
    monkeypatch.setitem(sys.modules, "rayserve_paged.ops.triton_backend", module)
    return TritonBackend


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "rayserve_paged.ops.triton_backend", None)


@pytest.mark.parametrize(
    "name, device", [("torch", "cpu"), ("torch", "cuda"), ("auto", "cpu"), ("auto", torch.device("cpu"))]
)
def test_get_attention_backend_gives_torch_reference(name, device):
    backend = get_attention_backend(name, device)
    assert type(backend) is TorchReferenceBackend and backend.name == "torch"


def test_auto_on_cuda_falls_back_to_torch_without_triton_backend(no_triton):
    assert type(get_attention_backend("auto", "cuda")) is TorchReferenceBackend


def test_auto_on_cuda_picks_triton_when_it_imports(fake_triton):
    assert type(get_attention_backend("auto", "cuda:0")) is fake_triton
    assert type(get_attention_backend("triton", "cuda")) is fake_triton


def test_triton_on_cpu_needs_interpret_mode(fake_triton, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        get_attention_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert type(get_attention_backend("triton", "cpu")) is fake_triton


def test_triton_that_cannot_import_says_why(no_triton):
    with pytest.raises(RuntimeError, match="'triton' cannot be imported"):
        get_attention_backend("triton", "cuda")


def test_flash_without_its_package_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)
    with pytest.raises(RuntimeError, match="needs the vllm_flash_attn package, which is not installed"):
        get_attention_backend("flash", "cuda")
    with pytest.raises(ValueError, match="'flash' needs a CUDA device"):
        get_attention_backend("flash", "cpu")


def test_unknown_backend_lists_valid_names():
    message = "unknown attention_backend 'xformers'; valid names: auto, torch, triton, flash"
    with pytest.raises(ValueError, match=message):
        get_attention_backend("xformers")


@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["kernel", "torch_path"])
@pytest.mark.parametrize("with_host_lists", [True, False])
def test_many_decodes_of_mixed_lengths_are_chunked_by_length_and_match_dense(
    with_host_lists, use_cpu_kernel, generator
):
    """Past DECODE_CHUNK sequences the torch decode path runs in length-sorted chunks; the
    result must be the same as one dense attention per sequence, in the original order."""
    from rayserve_paged.ops import paged_attention

    assert paged_attention.DECODE_CHUNK == 32
    decodes = [int(x) for x in torch.randint(0, 90, (75,), generator=generator)]
    batch, _, output, expected, _ = run_case(
        dict(prefills=[(5, 3)], decodes=decodes), generator, with_host_lists=with_host_lists,
        backend=TorchReferenceBackend(use_cpu_kernel=use_cpu_kernel),
    )
    num_real = batch.num_real_tokens
    torch.testing.assert_close(output[:num_real], expected[:num_real].float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "slots",
    [
        [5, PAD_SLOT, 9, PAD_SLOT, PAD_SLOT, 0],
        [PAD_SLOT, PAD_SLOT, 3, 4],  # padding before the first real token
        [PAD_SLOT, PAD_SLOT, PAD_SLOT],  # nothing to write
        [7, 1, 2],
    ],
    ids=["inner", "leading", "all_padding", "no_padding"],
)
def test_reshape_and_cache_without_masking_writes_exactly_what_masking_writes(slots, generator):
    """The CUDA path (fixed shapes, no boolean indexing, so no device sync), run here on CPU
    tensors: bit-identical caches to the masked copy, NaN slots included."""
    from rayserve_paged.ops import cache_ops

    key = torch.randn(len(slots), 2, 8, generator=generator)  # [num_tokens, kv_heads, d]
    value = torch.randn(len(slots), 2, 8, generator=generator)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    expected = [torch.full((3, 4, 2, 8), float("nan")) for _ in range(2)]
    expected[0][0, 0] = 1.5  # slot 0 holds data the all-padding case must leave alone
    actual = [cache.clone() for cache in expected]
    cache_ops.reshape_and_cache(key, value, *expected, slot_mapping)
    flat = [cache.view(12, 2, 8) for cache in actual]
    cache_ops._write_fixed_shape(key, value, *flat, slot_mapping)
    for got, want in zip(actual, expected):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    written = 16 * sum(slot != PAD_SLOT for slot in slots)  # 16 values per slot (2 kv heads x 8)
    assert int((~actual[0].isnan()).sum()) == written + (16 if 0 not in slots else 0)  # + the preset slot 0


# ---------------------------------------------------------------------------- BlockSwapper


def _swap_layers(generator, num_blocks, num_layers=2):
    shape = (num_blocks, 4, 2, 8)  # [num_blocks, block_size, kv_heads, head_dim]
    return [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
            for _ in range(num_layers)]


def test_block_swapper_reads_sources_before_the_step_writes(generator):
    """Swap out, then the step overwrites the source blocks (they were freed): the host pool
    holds the old contents once finish() has run; a swap-in in the same step sees them too."""
    from rayserve_paged.ops.cache_ops import BlockSwapper

    device, host = _swap_layers(generator, 6), _swap_layers(generator, 5)
    expected_host = [(k.clone(), v.clone()) for k, v in host]
    for (k, v), (ek, ev) in zip(device, expected_host):
        ek[[4, 0]] = k[[1, 3]]
        ev[[4, 0]] = v[[1, 3]]
    swapper = BlockSwapper(device, host)
    swapper.swap_out([(1, 4), (3, 0)])
    for k, v in device:  # the step reuses the swapped-out blocks
        k[[1, 3]] = 7.0
        v[[1, 3]] = 7.0
    swapper.swap_in([(4, 3)])  # finishes the swap-out first, then brings block 4 back into 3
    for (k, v), (ek, ev) in zip(host, expected_host):
        assert torch.equal(k, ek) and torch.equal(v, ev)
    for (k, v), (ek, ev) in zip(device, expected_host):
        assert torch.equal(k[3], ek[4]) and torch.equal(v[3], ev[4])
        assert bool((k[1] == 7.0).all())
    assert swapper.pending == []


def test_block_swapper_copies_once_per_run_of_consecutive_ids_and_matches_swap_kv_blocks(generator):
    """Random swap sets out and back in: the pools end as swap_kv_blocks (the one-gather
    reference) leaves them, with one copy per cache tensor per run of pairs whose source and
    destination ids are both consecutive."""
    import random

    from rayserve_paged.ops.cache_ops import BlockSwapper

    rng = random.Random(0)
    for trial in range(6):
        device, host = _swap_layers(generator, 12), _swap_layers(generator, 10)
        expected_device, expected_host = [[t.clone() for t in pair] for pair in device], [[t.clone() for t in pair] for pair in host]
        swapper = BlockSwapper(device, host)
        count = rng.randint(1, 8)
        out = list(zip(rng.sample(range(12), count), rng.sample(range(10), count)))
        back = list(zip(rng.sample(range(10), count), rng.sample(range(12), count)))
        swap_kv_blocks(expected_device, expected_host, out)
        swap_kv_blocks(expected_host, expected_device, back)
        swapper.swap_out(out)
        swapper.swap_in(back)
        swapper.finish()
        for got, want in ((device, expected_device), (host, expected_host)):
            for (k, v), (ek, ev) in zip(got, want):
                assert torch.equal(k, ek) and torch.equal(v, ev), trial
        runs = [BlockSwapper._runs(pairs, 12, 12) for pairs in (out, back)]
        for pairs, found in zip((out, back), runs):  # every pair in exactly one run
            covered = sorted((s + i, d + i) for s, d, n in found for i in range(n))
            assert covered == sorted(pairs)
        assert swapper.num_runs == sum(map(len, runs)) and swapper.num_copies == 4 * swapper.num_runs


def test_block_swapper_runs_need_both_ids_consecutive(generator):
    from rayserve_paged.ops.cache_ops import BlockSwapper

    device, host = _swap_layers(generator, 12, num_layers=3), _swap_layers(generator, 10, num_layers=3)
    swapper = BlockSwapper(device, host)
    assert BlockSwapper._runs([(3, 6), (1, 4), (2, 5), (7, 0), (8, 2), (9, 3)], 12, 10) == [
        (1, 4, 3), (7, 0, 1), (8, 2, 2)
    ]
    swapper.swap_out([(3, 6), (1, 4), (2, 5)])  # one run in any order: one copy per cache tensor
    assert (swapper.num_runs, swapper.num_copies) == (1, 6)
    swapper.swap_in([(0, 11), (1, 0)])  # consecutive sources, destinations not: two runs
    assert (swapper.num_runs, swapper.num_copies) == (3, 18)
    swapper.swap_out([])
    assert (swapper.num_runs, swapper.num_copies) == (3, 18) and swapper.pending == []


def test_block_swapper_rejects_bad_mappings_before_copying(generator):
    from rayserve_paged.ops.cache_ops import BlockSwapper

    swapper = BlockSwapper(_swap_layers(generator, 6), _swap_layers(generator, 5))
    with pytest.raises(ValueError, match=r"destination block 5 is outside \[0, 5\)"):
        swapper.swap_out([(0, 5)])
    with pytest.raises(ValueError, match="repeated destination"):
        swapper.swap_in([(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="2 device layers but 1 host layers"):
        BlockSwapper(_swap_layers(generator, 6), _swap_layers(generator, 5, num_layers=1))
    assert swapper.pending == []


# ---------------------------------------------------------------------------- checks once per step


def _layers(batch, generator, num_layers, **kw):
    return [
        make_attention_inputs(batch, num_heads=4, num_kv_heads=2, head_dim=16, generator=generator, **kw)
        for _ in range(num_layers)
    ]


def test_begin_step_rejects_bad_metadata_before_any_layer(generator):
    batch = make_metadata(**CASES["mixed"], block_size=16, generator=generator)
    backend = TorchReferenceBackend()
    bad = dataclasses.replace(batch.metadata, decode_seq_lens_host=[5] * (batch.metadata.num_decodes + 1))
    with pytest.raises(ValueError, match="decode_seq_lens_host=.* disagrees with num_decodes"):
        backend.begin_step(bad)
    with pytest.raises(ValueError, match="num_decode_tokens=2 != len"):
        backend.begin_step(dataclasses.replace(batch.metadata, num_decode_tokens=2))


def test_checks_run_once_per_step_not_per_layer(generator, monkeypatch):
    from rayserve_paged.ops import paged_attention

    calls = {"step": 0, "layer": 0}

    step_check, layer_check = paged_attention.check_step_metadata, paged_attention.check_layer_inputs
    monkeypatch.setattr(paged_attention, "check_step_metadata", counted(calls, "step", step_check))
    monkeypatch.setattr(paged_attention, "check_layer_inputs", counted(calls, "layer", layer_check))
    batch = make_metadata(**CASES["mixed"], block_size=16, generator=generator)
    layers = _layers(batch, generator, num_layers=4)
    backend = TorchReferenceBackend()
    for step in range(2):
        metadata = dataclasses.replace(batch.metadata)  # each step builds a new metadata object
        backend.begin_step(metadata)
        for layer in layers:
            backend.forward(layer.query, layer.key, layer.value, layer.key_cache, layer.value_cache, metadata, 0.25)
        assert calls == {"step": step + 1, "layer": step + 1}
    # a layer whose inputs differ from the checked ones (here: strided key/value) is checked in full
    other = _layers(batch, generator, num_layers=1)[0]
    kv = torch.cat((other.key, other.value), dim=1)  # [num_tokens, 2 * kv_heads, d]
    backend.forward(other.query, kv[:, :2], kv[:, 2:], other.key_cache, other.value_cache, metadata, 0.25)
    assert calls == {"step": 2, "layer": 3}


def test_bad_layer_after_checked_layers_still_raises(generator):
    batch = make_metadata(**CASES["mixed"], block_size=16, generator=generator)
    good, bad = _layers(batch, generator, num_layers=2)
    backend = TorchReferenceBackend()
    backend.begin_step(batch.metadata)
    backend.forward(good.query, good.key, good.value, good.key_cache, good.value_cache, batch.metadata, 0.25)
    with pytest.raises(ValueError, match="query dtype torch.float64"):
        backend.forward(bad.query.double(), bad.key, bad.value, bad.key_cache, bad.value_cache, batch.metadata, 0.25)


def test_layers_sharing_one_step_plan_match_dense(generator):
    batch = make_metadata(**CASES["mixed"], block_size=16, generator=generator)
    layers = _layers(batch, generator, num_layers=3)
    backend = TorchReferenceBackend()
    backend.begin_step(batch.metadata)
    for layer in layers:
        expected = dense_attention(layer, batch, 0.25)
        caches_after = expected_caches(layer, batch)
        out = backend.forward(
            layer.query, layer.key, layer.value, layer.key_cache, layer.value_cache, batch.metadata, 0.25
        )
        num_real = batch.num_real_tokens
        torch.testing.assert_close(out[:num_real], expected[:num_real].float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.key_cache, caches_after[0], atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(layer.value_cache, caches_after[1], atol=0, rtol=0, equal_nan=True)
