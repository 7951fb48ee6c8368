"""Chunked prefill end to end: token-for-token equal to HF generate with a small budget."""

from __future__ import annotations

import random

import pytest

from rayserve_paged import LLM, SamplingParams

from .conftest import hf_generate


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(4, vocab) for _ in range(40)]
    # 7, 65, 200 and 130 tokens: the first three are admitted together into 20 blocks and
    # outgrow them as they decode
    return [
        [rng.randrange(4, vocab) for _ in range(7)],
        shared + [rng.randrange(4, vocab) for _ in range(25)],
        [rng.randrange(4, vocab) for _ in range(200)],
        shared + [rng.randrange(4, vocab) for _ in range(90)],
    ]


@pytest.mark.parametrize("arch", ["opt", "llama"])
@pytest.mark.parametrize(
    "budget,mode,caching,blocks",
    [(16, "recompute", True, None), (48, "swap", False, 20), (16, "swap", True, 20), (48, "recompute", False, 20)],
)
def test_chunked_prefill_equals_hf(tiny_paths, hf_reference, arch, budget, mode, caching, blocks):
    llm = LLM(
        model=tiny_paths[arch], max_model_len=256, max_num_batched_tokens=budget, max_num_seqs=8,
        enable_chunked_prefill=True, preemption_mode=mode, enable_prefix_caching=caching,
        num_gpu_blocks_override=blocks, kv_cache_memory_gb=None if blocks else 0.05, swap_space_gb=0.05,
    )
    model, _ = hf_reference(arch)
    prompts = _prompts(model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    expected = [hf_generate(model, p, max_new_tokens=40, do_sample=False, num_beams=1, min_new_tokens=40)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if blocks is not None:  # 20 blocks of 16 (one max_model_len + 4) for 4 prompts of up to 220 tokens: preemption happened
        counters = llm.engine.scheduler.counters
        assert counters.preemptions_recompute + counters.preemptions_swap > 0
    usage = llm.engine.block_manager.usage()
    assert usage.gpu_used == 0 and usage.cpu_used == 0


@pytest.mark.parametrize("arch", ["opt"])
def test_beam_search_and_best_of_fork_after_the_last_chunk(tiny_paths, hf_reference, arch):
    llm = LLM(model=tiny_paths[arch], max_model_len=256, max_num_batched_tokens=16, max_num_seqs=8, kv_cache_memory_gb=0.05)
    model, _ = hf_reference(arch)
    prompt = _prompts(model.config.vocab_size)[3]
    params = SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=8)
    (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    expected = hf_generate(
        model, prompt, max_new_tokens=8, do_sample=False, num_beams=2, num_return_sequences=2,
        length_penalty=1.0, early_stopping=False,
    )
    assert [c.token_ids for c in out.outputs] == expected
    seeded = SamplingParams(n=2, best_of=3, temperature=1.0, seed=5, max_tokens=6)
    chunked = llm.generate(prompt_token_ids=[prompt], sampling_params=seeded, use_tqdm=False)[0]
    whole = LLM(model=tiny_paths[arch], max_model_len=256, enable_chunked_prefill=False, kv_cache_memory_gb=0.05)
    unchunked = whole.generate(prompt_token_ids=[prompt], sampling_params=seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in chunked.outputs] == [c.token_ids for c in unchunked.outputs]
