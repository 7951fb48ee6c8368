"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF's float32 log-softmax of the
same logits, with chunked prefill, a prefix cache that holds the prompts, and batching
beside plain requests."""

from __future__ import annotations

import random

import pytest
import torch

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.core.sequence import SamplingParamsError

from .conftest import hf_logits


@pytest.fixture(scope="module")
def checkpoint(family_checkpoint):
    return family_checkpoint


def _assert_matches_hf(hf, prompt: list[int], scores, k: int) -> None:
    assert len(scores) == len(prompt) and scores[0] is None
    expected = torch.log_softmax(hf_logits(hf, prompt), dim=-1)  # [len, vocab]
    for p in range(1, len(prompt)):
        row = expected[p - 1]
        got = scores[p]
        assert abs(got[prompt[p]] - row[prompt[p]].item()) < 1e-4, p
        top_values, top_ids = row.topk(k)
        assert set(top_ids.tolist()) <= set(got), p
        assert len(got) in (k, k + 1)
        for t, v in zip(top_ids.tolist(), top_values.tolist()):
            assert abs(got[t] - v) < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_prompt_logprobs_equal_hf_with_chunks_and_prefix_cache(family, checkpoint, hf_model):
    path = checkpoint(family)
    rng = random.Random(hash(family) % 1000)
    shared = [1] + [rng.randrange(3, 512) for _ in range(23)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 1)] + [[1, 300]]
    llm = LLM(
        model=path, block_size=8, max_model_len=96, kv_cache_memory_gb=0.05, enable_prefix_caching=True,
        enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate(prompt_token_ids=[shared + [7, 8]], sampling_params=plain, use_tqdm=False)  # caches the shared blocks
    k = 3
    scored = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)
    outputs = llm.generate(
        prompt_token_ids=[*prompts, shared + [9]], sampling_params=[scored] * len(prompts) + [plain], use_tqdm=False
    )
    hf = hf_model(path)
    for prompt, out in zip(prompts, outputs):
        assert out.num_cached_tokens == 0  # a scored request skips the prefix-cache lookup
        _assert_matches_hf(hf, prompt, out.prompt_logprobs, k)
    assert outputs[-1].num_cached_tokens > 0 and outputs[-1].prompt_logprobs is None


def test_prompt_logprobs_zero_and_bad_values(checkpoint, hf_model):
    path = checkpoint("llama")
    llm = LLM(model=path, block_size=8, max_model_len=96, kv_cache_memory_gb=0.05)
    prompt = [1, *range(40, 60)]
    (out,) = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    assert all(len(s) == 1 for s in out.prompt_logprobs[1:])
    _assert_matches_hf(hf_model(path), prompt, out.prompt_logprobs, 0)
    for bad in (-1, 1.5, True):
        with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
