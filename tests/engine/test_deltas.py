"""The engine emits per-step deltas (token ids and counts, no text); the output processor
at the edge builds text, cuts stop strings and ends the choice in the engine at once."""

from __future__ import annotations

import pytest

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.engine.output_processor import OutputKind, OutputProcessor


@pytest.fixture(scope="module")
def llm(tiny_paths):
    return LLM(model=tiny_paths["opt"], device="cpu", max_model_len=128, num_gpu_blocks_override=64,
               swap_space_gb=0.01)  # fmt: skip


def test_each_step_carries_only_its_new_tokens(llm):
    engine = llm.engine
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    (whole,) = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    engine.add_request("d", None, params, prompt_token_ids=[5, 6, 7, 8])
    joined: dict[int, list[int]] = {0: [], 1: []}
    while engine.has_unfinished_requests():
        (out,) = engine.step()
        assert not hasattr(out, "text") and all(len(d.token_ids) == 1 for d in out.outputs)  # one token a step
        for delta in out.outputs:
            joined[delta.index] += delta.token_ids
            assert delta.num_output_tokens == len(joined[delta.index])
    assert out.finished and [d.finish_reason for d in out.outputs] == ["length", "length"]
    assert [joined[0], joined[1]] == [c.token_ids for c in whole.outputs]


def test_a_stop_string_ends_the_request_in_the_engine_at_once(llm):
    engine = llm.engine
    free = engine.block_manager.num_free_gpu_blocks()
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (plain,) = llm.generate([[9, 10, 11]], greedy, use_tqdm=False)
    text = plain.outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    (stopped,) = llm.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                            stop=[stop]), use_tqdm=False)  # fmt: skip
    choice = stopped.outputs[0]
    assert choice.text == text[: text.index(stop)] and (choice.finish_reason, choice.stop_reason) == ("stop", stop)
    assert len(choice.token_ids) < 40  # the tokens up to the one that completed the stop string
    assert plain.outputs[0].token_ids[: len(choice.token_ids)] == choice.token_ids
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_gpu_blocks() == free


def test_delta_outputs_hold_back_a_possible_stop_string(llm):
    tokenizer = llm.get_tokenizer()
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["zzzz"])
    engine = llm.engine
    engine.add_request("h", None, params, prompt_token_ids=[9, 10, 11])
    processor.add_request("h", None, [9, 10, 11], params, OutputKind.DELTA)
    sent = ""
    while engine.has_unfinished_requests():
        for step_output in engine.step():
            out, stop = processor.process(step_output)
            assert stop is None
            if out is not None and out.outputs:
                sent += out.outputs[0].text
            if not step_output.finished:  # len("zzzz") - 1 characters stay unsent while running
                full = processor.requests["h"].choices[0].text
                assert full.startswith(sent) and len(full) - len(sent) == min(3, len(full))
    (plain,) = llm.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                            use_tqdm=False)  # fmt: skip
    assert sent == plain.outputs[0].text
