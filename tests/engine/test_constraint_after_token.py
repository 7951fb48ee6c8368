"""A constraint that starts after a token (StructuredOutputsParams.after_token_id: a
reasoning model's </think>): the output is free until that token, constrained from the next."""

from __future__ import annotations

import pytest

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.core.sequence import SamplingParamsError, StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(tiny_paths):
    return LLM(model=tiny_paths["opt"], max_model_len=128, num_gpu_blocks_override=32, swap_space_gb=0.01)


def test_the_constraint_starts_after_its_token_in_every_fork(llm):
    tokenizer = llm.engine.tokenizer
    start = tokenizer.convert_tokens_to_ids("Ġthe")
    constraint = StructuredOutputsParams(choice=["yes", "no"], after_token_id=start)
    # a bias makes `start` the first token (free: without the wait the grammar would mask it)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, structured_outputs=constraint,
                            logit_bias={start: 50.0})  # fmt: skip
    (out,) = llm.generate(["hello world"], params, use_tqdm=False)
    for choice in out.outputs:
        assert choice.token_ids[0] == start, choice.token_ids
        assert tokenizer.decode(choice.token_ids[1:]) in ("yes", "no") and choice.finish_reason == "stop"
    # a token that never comes: the output stays free up to max_tokens
    never = StructuredOutputsParams(choice=["yes"], after_token_id=tokenizer.eos_token_id)
    (free,) = llm.generate(["hello world"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                           structured_outputs=never), use_tqdm=False)  # fmt: skip
    assert free.outputs[0].finish_reason == "length" and len(free.outputs[0].token_ids) == 6
    assert not llm.engine.structured.matchers and not llm.engine.structured.waiting


def test_after_token_id_is_checked():
    with pytest.raises(SamplingParamsError, match="after_token_id"):
        StructuredOutputsParams(regex="a", after_token_id=-1)
    with pytest.raises(SamplingParamsError, match="after_token_id"):
        StructuredOutputsParams(regex="a", after_token_id=True)
