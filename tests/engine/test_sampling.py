"""Sampling behaviour through the real engine on the tiny OPT."""

from __future__ import annotations

import math

import pytest

from rayserve_paged import LLM, SamplingParams, SamplingParamsError
from rayserve_paged.engine.llm_engine import RequestError

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def llm(tiny_paths):
    return LLM(model=tiny_paths["opt"], max_model_len=256, kv_cache_memory_gb=0.05, swap_space_gb=0.01)


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm, tiny_paths):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1234, n=2)
    alone = llm.generate([PROMPT], seeded, use_tqdm=False)
    other = SamplingParams(temperature=1.0, max_tokens=20)
    batch = llm.generate(["Hello there", PROMPT, "Another prompt entirely"], [other, seeded, other], use_tqdm=False)
    assert _tokens(alone)[0] == _tokens(batch)[1]
    fresh = LLM(model=tiny_paths["opt"], max_model_len=256, kv_cache_memory_gb=0.05, swap_space_gb=0.01)
    assert _tokens(fresh.generate([PROMPT], seeded, use_tqdm=False))[0] == _tokens(alone)[0]
    assert alone[0].outputs[0].token_ids != alone[0].outputs[1].token_ids  # two different samples
    different = llm.generate([PROMPT], SamplingParams(temperature=0.9, max_tokens=16, seed=99), use_tqdm=False)
    assert _tokens(different)[0][0] != _tokens(alone)[0][0]


def test_parallel_samples_share_the_prompt_blocks(llm):
    engine = llm.engine
    prompt_ids = list(range(10, 10 + 40))  # 40 tokens: blocks 0 and 1 full, 2 partial
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True, seed=5)  # no early EOS
    engine.add_request("shared", None, params, prompt_token_ids=prompt_ids)
    engine.step()  # prefill, then the engine forks the parent into 4 sequences
    group = engine.scheduler.groups["shared"]
    assert len(group.seqs) == 4
    tables = [engine.block_manager.gpu_tables[s.seq_id] for s in group.seqs]
    assert len({tuple(t[:2]) for t in tables}) == 1  # the full prompt blocks: one copy
    for bid in tables[0][:3]:
        assert engine.block_manager.gpu.blocks[bid].ref_count == 4
    engine.step()  # each writes its first sampled token into the shared last block: CoW
    tables = [engine.block_manager.gpu_tables[s.seq_id] for s in group.seqs]
    assert len({t[2] for t in tables}) == 4
    assert engine.block_manager.gpu.blocks[tables[0][0]].ref_count == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.usage().gpu_used == 0


def test_best_of_returns_the_n_most_likely(llm):
    (out,) = llm.generate([PROMPT], SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=6, seed=7), use_tqdm=False)
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    (all5,) = llm.generate([PROMPT], SamplingParams(n=5, temperature=1.0, max_tokens=6, seed=7), use_tqdm=False)
    best = sorted((c.cumulative_logprob for c in all5.outputs), reverse=True)[:2]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(best)


def test_logprobs_are_the_models_and_sum_to_the_cumulative(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for token, top in zip(c.token_ids, c.logprobs):
        assert token in top and len(top) == 3  # greedy: the sampled token is the top one
        assert top[token] == max(top.values())
        assert all(v <= 0 for v in top.values())
    assert math.isclose(sum(top[t] for t, top in zip(c.token_ids, c.logprobs)), c.cumulative_logprob, rel_tol=1e-5)


def test_top_k_1_is_greedy_and_min_p_1_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    top1 = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_k=1, max_tokens=10), use_tqdm=False)
    minp = llm.generate([PROMPT], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=10), use_tqdm=False)
    assert _tokens(greedy) == _tokens(top1) == _tokens(minp)


def test_penalties_change_greedy_output_and_avoid_repeats(llm):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    penalised = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, presence_penalty=2.0), use_tqdm=False
    )
    a, b = plain[0].outputs[0].token_ids, penalised[0].outputs[0].token_ids
    assert a != b
    assert len(set(b)) > len(set(a))  # the tiny model repeats itself; the penalty spreads it out


def test_stop_token_ids_and_max_tokens(llm):
    (ref,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = ref.outputs[0].token_ids
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    (out,) = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]), use_tqdm=False
    )
    c = out.outputs[0]
    assert c.token_ids == tokens[: first + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_at)
    assert ref.outputs[0].finish_reason == "length" and len(tokens) == 12


def test_stop_string_is_cut_from_the_text(llm):
    (ref,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    text = ref.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    (out,) = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]), use_tqdm=False
    )
    c = out.outputs[0]
    assert c.text == text[: text.index(stop)]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    (kept,) = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_text_is_the_detokenized_output(llm):
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    c = out.outputs[0]
    assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(use_beam_search=True, n=1), "best_of"),
        (dict(use_beam_search=True, n=2, temperature=0.8), "temperature"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_are_refused_and_the_engine_keeps_serving(llm):
    engine = llm.engine
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("e1", None, SamplingParams(), prompt_token_ids=[])
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request("e2", None, SamplingParams(), prompt_token_ids=[1, 10**6])
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("e3", None, SamplingParams(), prompt_token_ids=[5] * 300)
    with pytest.raises(SamplingParamsError, match="logprobs"):
        engine.add_request("e4", "hi", SamplingParams(logprobs=100))
    assert not engine.has_unfinished_requests()
    (out,) = llm.generate(["still serving"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 1


def test_abort_frees_the_request_at_once(llm):
    engine = llm.engine
    engine.add_request("gone", PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True, seed=1))
    engine.step()
    engine.step()
    assert engine.block_manager.usage().gpu_used > 0
    assert engine.abort_request("gone")
    assert engine.block_manager.usage().gpu_used == 0
    assert not engine.has_unfinished_requests()
    assert not engine.abort_request("gone")


def test_token_ids_past_the_tokenizers_vocab_decode_to_no_text(llm):
    # checkpoints often pad the embedding past the tokenizer (OPT: 50272 rows, 50265 tokens)
    tokenizer = llm.get_tokenizer()
    detokenizer = llm.processor.detokenizer
    state = detokenizer.start([1, 50, 60], True)
    assert detokenizer.decode_next(state, len(tokenizer) + 3, True) == ""
    assert detokenizer.decode_next(state, 70, True) == tokenizer.decode([70])


def test_length_penalty_is_bounded():
    # beam scores divide by generated_len ** length_penalty: huge values overflow the step
    for bad in (1e308, -1e9, float("nan")):
        with pytest.raises(SamplingParamsError, match="length_penalty"):
            SamplingParams(n=2, use_beam_search=True, temperature=0.0, length_penalty=bad)
