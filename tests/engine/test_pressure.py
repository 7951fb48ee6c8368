"""Engine-level defects under pressure: workers forget ended requests, generate() leaves
the engine empty on error, top-p after top-k, beam search refuses penalties."""

from __future__ import annotations

import pytest
import torch

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.core.sequence import SamplingParamsError
from rayserve_paged.models.sampler import Sampler


def test_workers_forget_the_last_finished_request_without_a_further_step(tiny_paths):
    llm = LLM(model=tiny_paths["opt"], max_model_len=128, kv_cache_memory_gb=0.01)
    batch = llm.engine.executor.worker.runner.batch
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert (batch.num_requests, batch.num_seqs) == (0, 0)
    llm.engine.step()  # nothing to run, nothing held
    assert (batch.num_requests, batch.num_seqs) == (0, 0)


def test_generate_leaves_the_engine_empty_when_a_step_fails(tiny_paths):
    llm = LLM(model=tiny_paths["opt"], max_model_len=128, kv_cache_memory_gb=0.01)
    executor = llm.engine.executor
    real = executor.execute
    calls = []

    def failing(out):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("worker died")
        return real(out)

    executor.execute = failing
    with pytest.raises(RuntimeError, match="worker died"):
        llm.generate(prompt_token_ids=[[5, 6], [7, 8, 9]], sampling_params=SamplingParams(max_tokens=8), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    executor.execute = real
    (out,) = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_top_p_is_measured_on_what_top_k_leaves_as_hf_does():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]])
    probs = Sampler()._truncated_probs(logits.clone(), temperatures=[1.0], top_ks=[3], top_ps=[0.6], min_ps=None)
    hf = TopPLogitsWarper(0.6)(None, TopKLogitsWarper(3)(None, logits.clone())).softmax(dim=-1)
    # over the whole vocabulary token 0 alone holds < 0.6 and token 1 would be kept; over
    # the top 3 tokens 0 and 1 reach 0.6 ... either way the kept set must be HF's
    assert (probs > 0).tolist() == (hf > 0).tolist()
    torch.testing.assert_close(probs, hf)
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.3]])
    probs = Sampler()._truncated_probs(logits.clone(), temperatures=[1.0], top_ks=[4], top_ps=[0.5], min_ps=None)
    hf = TopPLogitsWarper(0.5)(None, TopKLogitsWarper(4)(None, logits.clone())).softmax(dim=-1)
    assert (probs > 0).tolist() == (hf > 0).tolist()  # 2 kept of the top 4, not 4 of 8
    torch.testing.assert_close(probs, hf)


@pytest.mark.parametrize("penalty", [dict(presence_penalty=0.5), dict(frequency_penalty=0.5), dict(repetition_penalty=1.2)])
def test_beam_search_refuses_penalties_with_the_field_named(penalty):
    name = next(iter(penalty))
    with pytest.raises(SamplingParamsError, match=name):
        SamplingParams(n=2, use_beam_search=True, temperature=0.0, **penalty)
