"""Greedy and beam-search output equal HF transformers' generate, token for token."""

from __future__ import annotations

import pytest

from benchmarks.gpu_e2e import PROMPTS  # the GPU check runs the same prompts against HF
from rayserve_paged import LLM, SamplingParams

from .conftest import hf_generate


def _engine(path, **options):
    options.setdefault("max_model_len", 256)
    options.setdefault("swap_space_gb", 0.01)
    options.setdefault("kv_cache_memory_gb", 0.05)
    return LLM(model=path, **options)


def _hf_greedy(hf_reference, arch, prompt_ids, max_tokens):
    model, _ = hf_reference(arch)
    return [hf_generate(model, ids, max_new_tokens=max_tokens, do_sample=False, num_beams=1)[0] for ids in prompt_ids]


def _greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.mark.parametrize("arch", ["opt", "llama"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_greedy_equals_hf_for_a_batch(tiny_paths, hf_reference, arch, block_size):
    llm = _engine(tiny_paths[arch], block_size=block_size)
    outputs = llm.generate(PROMPTS, _greedy(24), use_tqdm=False)
    prompt_ids = [o.prompt_token_ids for o in outputs]
    expected = _hf_greedy(hf_reference, arch, prompt_ids, 24)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    usage = llm.engine.block_manager.usage()
    assert usage.gpu_used == 0 and usage.cpu_used == 0


@pytest.mark.parametrize("arch", ["opt", "llama"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_hf_under_preemption(tiny_paths, hf_reference, arch, mode):
    # 12 blocks of 16 tokens for 4 requests that grow to ~60 tokens each: must preempt
    llm = _engine(
        tiny_paths[arch], num_gpu_blocks_override=12, max_model_len=192, preemption_mode=mode, swap_space_gb=0.05,
        enable_prefix_caching=False,
    )
    outputs = llm.generate(PROMPTS, _greedy(48), use_tqdm=False)
    counters = llm.engine.scheduler.counters
    if mode == "swap":
        assert counters.preemptions_swap > 0
        assert llm.engine.block_manager.counters.swapped_in_blocks > 0
    else:
        assert counters.preemptions_recompute > 0 and counters.preemptions_swap == 0
    expected = _hf_greedy(hf_reference, arch, [o.prompt_token_ids for o in outputs], 48)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    usage = llm.engine.block_manager.usage()
    assert usage.gpu_used == 0 and usage.cpu_used == 0


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_prefix_caching_hits_and_output_is_unchanged(tiny_paths, hf_reference, arch):
    llm = _engine(tiny_paths[arch], block_size=16)
    shared = (
        "You are a helpful assistant. Answer briefly and precisely, and always explain the reasoning "
        "behind each step of the answer that you give to the user. "
    )
    prompts = [shared + q for q in ("What is a block?", "Why page memory?", "Who wrote this?")]
    first = llm.generate(prompts[:1], _greedy(8), use_tqdm=False)
    computed_before = llm.engine.num_prompt_tokens
    rest = llm.generate(prompts[1:], _greedy(8), use_tqdm=False)
    counters = llm.engine.block_manager.counters
    assert counters.prefix_cache_hits >= 2 * 16 * 2  # both later prompts reuse full shared blocks
    prompt_tokens = sum(len(o.prompt_token_ids) for o in rest)
    assert llm.engine.num_prompt_tokens - computed_before <= prompt_tokens - counters.prefix_cache_hits
    outputs = first + rest
    expected = _hf_greedy(hf_reference, arch, [o.prompt_token_ids for o in outputs], 8)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("arch", ["opt", "llama"])
@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_hf(tiny_paths, hf_reference, arch, width):
    llm = _engine(tiny_paths[arch])
    model, _ = hf_reference(arch)
    params = SamplingParams(n=width, use_beam_search=True, temperature=0.0, max_tokens=12)
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for o in outputs:
        expected = hf_generate(
            model, o.prompt_token_ids, max_new_tokens=12, do_sample=False, num_beams=width,
            num_return_sequences=width, length_penalty=1.0, early_stopping=False,
        )
        assert [c.token_ids for c in o.outputs] == expected
    assert llm.engine.block_manager.usage().gpu_used == 0
