"""The CPU attention paths against the dense reference: the compiled decode kernel, the torch
decode path (the fallback without a compiler), prefill on its own K/V and prefill over cached
context; and the kernel's build cache and fallback.

Shapes cover grouped-query attention, head sizes 64/80/128, block sizes 8/16/32, lengths on
and across block boundaries and zero-length contexts. Caches are poisoned with NaN wherever
nothing was written (builders.py), so a path that reads a stale slot fails.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rayserve_paged.ops import PAD_SLOT, TorchReferenceBackend, cpu_decode, reshape_and_cache
from rayserve_paged.ops.cache_ops import cpu_slot_writes, write_slots

from .builders import make_attention_inputs, make_metadata
from .test_reference import dense_attention, run_case

requires_compiler = pytest.mark.skipif(cpu_decode.compiler() is None, reason="needs a C++ compiler")

PATHS = {"kernel": True, "torch_path": False}


def check_matches_dense(batch, output, expected, atol=1e-5):
    num_real = batch.num_real_tokens
    torch.testing.assert_close(output[:num_real], expected[:num_real].float(), atol=atol, rtol=1e-5)
    assert not output[num_real:].any()  # padding rows are zeros


# ---------------------------------------------------------------------------- decode and prefill

# (num_heads, num_kv_heads, head_dim): MHA, GQA 2/3/4 with the head sizes of real models
SHAPES = [(4, 4, 64), (8, 2, 64), (6, 2, 80), (4, 1, 128)]
# context lengths on, just before and just after block boundaries of 8/16/32, and zero
DECODE_CONTEXTS = [0, 7, 8, 15, 16, 17, 31, 32, 33, 63, 100]


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}_kv{s[1]}_d{s[2]}")
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_dense(path, shape, block_size, generator):
    num_heads, num_kv_heads, head_dim = shape
    backend = TorchReferenceBackend(use_cpu_kernel=path)
    batch, inputs, output, expected, caches_after = run_case(
        dict(decodes=DECODE_CONTEXTS, num_pad_tokens=2), generator, block_size=block_size,
        head_dim=head_dim, heads=(num_heads, num_kv_heads), backend=backend, strided_kv=True,
    )  # fmt: skip
    check_matches_dense(batch, output, expected)
    torch.testing.assert_close(inputs.key_cache, caches_after[0], atol=0, rtol=0, equal_nan=True)
    assert (backend._kernel is not None) == (path and cpu_decode.load() is not None)


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}_kv{s[1]}_d{s[2]}")
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_and_chunks_mixed_with_decodes_match_dense(path, shape, block_size, generator):
    """Fresh prompts (own K/V, is_causal), prompts over cached context (prefix hits, later
    chunks of a chunked prefill) and decodes in one step."""
    num_heads, num_kv_heads, head_dim = shape
    case = dict(prefills=[(0, 1), (0, 33), (block_size, 5), (block_size + 3, block_size + 1), (40, 1)],
                decodes=[0, block_size - 1, 2 * block_size], num_pad_tokens=1)  # fmt: skip
    batch, _, output, expected, _ = run_case(
        case, generator, block_size=block_size, head_dim=head_dim, heads=(num_heads, num_kv_heads),
        backend=TorchReferenceBackend(use_cpu_kernel=path), strided_kv=True,
    )  # fmt: skip
    check_matches_dense(batch, output, expected)


@settings(max_examples=30, deadline=None)
@given(
    prefills=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 40)), max_size=3),
    decodes=st.lists(st.integers(0, 90), max_size=6),
    block_size=st.sampled_from([8, 16, 32]),
    shape=st.sampled_from(SHAPES),
    path=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_batches_on_both_paths_match_dense(prefills, decodes, block_size, shape, path, seed):
    if not prefills and not decodes:
        decodes = [seed % 40]
    num_heads, num_kv_heads, head_dim = shape
    batch, _, output, expected, _ = run_case(
        dict(prefills=prefills, decodes=decodes), torch.Generator().manual_seed(seed), block_size=block_size,
        head_dim=head_dim, heads=(num_heads, num_kv_heads), backend=TorchReferenceBackend(use_cpu_kernel=path),
    )  # fmt: skip
    check_matches_dense(batch, output, expected)


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
def test_every_layer_of_a_step_reuses_the_plan_and_a_new_step_gets_its_own(path, generator):
    """Two "layers" (two cache pairs) with one metadata, then a second step: all exact."""
    backend = TorchReferenceBackend(use_cpu_kernel=path)
    for step in range(2):
        batch = make_metadata(prefills=[(9, 4)], decodes=[3 + step, 20, 47], block_size=16, generator=generator)
        plan = None
        for _layer in range(2):
            inputs = make_attention_inputs(batch, num_heads=4, num_kv_heads=2, head_dim=64, generator=generator)
            output = backend.forward(inputs.query, inputs.key, inputs.value, inputs.key_cache,
                                     inputs.value_cache, batch.metadata, 0.125)  # fmt: skip
            check_matches_dense(batch, output, dense_attention(inputs, batch, 0.125))
            assert plan is None or backend._plan is plan
            plan = backend._plan
        assert plan.metadata is batch.metadata


def test_decode_on_half_precision_uses_the_torch_path(generator):
    backend = TorchReferenceBackend()
    batch, _, output, expected, _ = run_case(dict(decodes=[5, 40]), generator, dtype=torch.bfloat16,
                                             backend=backend)  # fmt: skip
    assert output.dtype == torch.bfloat16 and backend._kernel is None
    torch.testing.assert_close(output[:2].double(), expected[:2], atol=8e-3, rtol=8e-3)


# ---------------------------------------------------------------------------- the kernel itself


@requires_compiler
def test_kernel_rejects_block_ids_outside_the_cache(generator):
    batch = make_metadata(decodes=[20, 3], block_size=8, generator=generator)
    inputs = make_attention_inputs(batch, num_heads=2, num_kv_heads=2, head_dim=64, generator=generator)
    tables = batch.metadata.decode_block_tables.clone()
    tables[0, 2] = batch.num_blocks  # one past the last block
    kernel = cpu_decode.load()
    out = torch.empty(2, 2, 64)
    with pytest.raises(ValueError, match=rf"block_tables\[0, 2\]={batch.num_blocks} is outside the cache's"):
        kernel(out, inputs.query, inputs.key_cache, inputs.value_cache, tables, batch.metadata.decode_seq_lens, 0.1)
    narrow = batch.metadata.decode_block_tables[:, :2].contiguous()
    too_long = torch.tensor([16, 17], dtype=torch.int32)  # 17 tokens need 3 blocks of 8; the table has 2
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=17 is negative or does not fit 2 blocks of 8"):
        kernel(out, inputs.query, inputs.key_cache, inputs.value_cache, narrow, too_long, 0.1)
    with pytest.raises(ValueError, match="block_tables must be contiguous int32"):
        kernel(out, inputs.query, inputs.key_cache, inputs.value_cache, batch.metadata.decode_block_tables[:, :2],
               too_long, 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="query must be contiguous float32"):
        kernel(out, inputs.query.double(), inputs.key_cache, inputs.value_cache, tables,
               batch.metadata.decode_seq_lens, 0.1)  # fmt: skip
    empty = inputs.key_cache[:, :0].contiguous()  # block size 0: a division by zero in the C code (SIGFPE)
    with pytest.raises(ValueError, match=r"block size must be >= 1, got caches \(\d+, 0, 2, 64\)"):
        kernel(out, inputs.query, empty, empty, tables, batch.metadata.decode_seq_lens, 0.1)


@requires_compiler
def test_kernel_with_two_threads_matches_one(generator):
    decodes = [int(x) for x in torch.randint(0, 200, (37,), generator=generator)]
    batch = make_metadata(decodes=decodes, block_size=16, generator=generator)
    inputs = make_attention_inputs(batch, num_heads=8, num_kv_heads=2, head_dim=64, generator=generator)
    reshape_and_cache(inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, batch.metadata.slot_mapping)
    kernel = cpu_decode.load()
    args = (inputs.query, inputs.key_cache, inputs.value_cache, batch.metadata.decode_block_tables,
            batch.metadata.decode_seq_lens, 0.125)  # fmt: skip
    one, two = torch.empty_like(inputs.query), torch.empty_like(inputs.query)
    kernel(one, *args)
    torch.set_num_threads(2)
    try:
        kernel(two, *args)
    finally:
        torch.set_num_threads(1)
    assert not one.isnan().any()
    assert torch.equal(one, two)  # same arithmetic per sequence, whichever thread runs it


# ---------------------------------------------------------------------------- build cache and fallback


@pytest.fixture
def fresh_kernel_state(tmp_path, monkeypatch):
    """An empty kernel cache and a process that has not decided about the kernel yet."""
    monkeypatch.setenv("RAYSERVE_PAGED_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_decode, "_loaded", {})
    return tmp_path


@requires_compiler
def test_kernel_is_built_once_and_later_processes_load_it(fresh_kernel_state):
    kernel = cpu_decode.load()
    assert kernel is not None and kernel.path.parent == fresh_kernel_state
    built = kernel.path.stat().st_mtime_ns
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from rayserve_paged.ops import cpu_decode; print(cpu_decode.load().path)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip().endswith(str(kernel.path))
    assert "compiled" not in result.stdout  # loaded from the cache, not rebuilt
    assert kernel.path.stat().st_mtime_ns == built
    assert [p.name for p in fresh_kernel_state.glob("*.so")] == [kernel.path.name]


def test_without_a_compiler_the_torch_path_runs_and_says_so(fresh_kernel_state, monkeypatch, caplog, generator):
    monkeypatch.setattr(cpu_decode, "compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        backend = TorchReferenceBackend()
        batch, _, output, expected, _ = run_case(dict(decodes=[0, 17, 40]), generator, backend=backend)
    check_matches_dense(batch, output, expected)
    assert backend._kernel is None
    assert "no C++ compiler found" in caplog.text and "torch path" in caplog.text


def test_a_failing_build_falls_back_with_the_compiler_error(fresh_kernel_state, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setattr(cpu_decode, "compiler", lambda: "false")
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        assert cpu_decode.load() is None
    assert "CPU paged-decode kernel unavailable" in caplog.text and "false failed" in caplog.text
    assert not list(fresh_kernel_state.glob("*.so"))


def test_the_kernel_can_be_switched_off(fresh_kernel_state, monkeypatch, caplog):
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "0")
    with caplog.at_level(logging.INFO, logger=cpu_decode.__name__):
        assert cpu_decode.load() is None
    assert f"{cpu_decode.DISABLE_ENV}=0" in caplog.text


@pytest.mark.parametrize("slots", [[5, 0, 17, 3], [5, PAD_SLOT, 17, PAD_SLOT], [PAD_SLOT, PAD_SLOT]])
def test_a_steps_slot_writes_computed_once_write_what_the_masked_copy_writes(slots, generator):
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    real = [s for s in slots if s != PAD_SLOT]
    written, is_real = cpu_slot_writes(slot_mapping)
    assert written.tolist() == real
    assert (is_real is None) == (len(real) == len(slots))
    key, value = (torch.randn(len(slots), 2, 4, generator=generator) for _ in range(2))
    caches = [torch.randn(3, 8, 2, 4, generator=generator) for _ in range(2)]
    want = [c.clone() for c in caches]
    for i, slot in enumerate(slots):  # the caches as [slot, head, dim] rows
        if slot != PAD_SLOT:
            want[0].view(24, 2, 4)[slot], want[1].view(24, 2, 4)[slot] = key[i], value[i]
    write_slots(key, value, *caches, slot_mapping, (written, is_real))
    assert all(torch.equal(c, w) for c, w in zip(caches, want))
