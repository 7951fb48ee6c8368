"""Structured outputs in the engine: on random-weight tiny models only the constraint makes
the output valid, so every check below fails without the grammar's bitmasks."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.core.sequence import SamplingParamsError, StructuredOutputsParams
from rayserve_paged.models.sampler import Sampler, SamplingBatch, bitmask_bias

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "main": {"type": "boolean"}},
            "required": ["zip", "main"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
PROMPTS = ["hello world", "the cat sat on", "a b c d e f g", "numbers: 1 2 3"]


@pytest.fixture(scope="module")
def llm(tiny_paths):
    return LLM(model=tiny_paths["opt"], max_model_len=256, num_gpu_blocks_override=64, swap_space_gb=0.01)


def _texts(llm, constraint, prompts=PROMPTS, **params):
    params.setdefault("max_tokens", 160)
    outs = llm.generate(prompts, SamplingParams(structured_outputs=constraint, **params), use_tqdm=False)
    return [c for o in outs for c in o.outputs]


def _arith(text: str) -> bool:
    return re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text) is not None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_meets_its_constraint(llm, temperature):
    seed = {"seed": 7} if temperature else {}
    for c in _texts(llm, {"json": SCHEMA}, temperature=temperature, **seed):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    for c in _texts(llm, {"regex": r"[a-z]{2,4}-[0-9]{2}"}, temperature=temperature, **seed):
        assert re.fullmatch(r"[a-z]{2,4}-[0-9]{2}", c.text) and c.finish_reason == "stop", c.text
    choices = ["yes", "no", "maybe later"]
    texts = [c.text for c in _texts(llm, {"choice": choices}, temperature=temperature, **seed)]
    assert set(texts) <= set(choices), texts
    for c in _texts(llm, {"grammar": GRAMMAR}, temperature=temperature, **seed):
        assert _arith(c.text) and c.finish_reason == "stop", c.text
    gbnf = 'root ::= "ab" [0-9] | "cd"'
    for c in _texts(llm, {"grammar": gbnf}, temperature=temperature, **seed):
        assert re.fullmatch(r"ab[0-9]|cd", c.text), c.text


def test_json_object_is_an_object(llm):
    # a random model writes endless keys; a bias towards '"' and '}' lets it close them
    tok = llm.get_tokenizer()
    bias = {tok.convert_tokens_to_ids(t): 30.0 for t in ('"', "}")}
    for c in _texts(llm, {"json_object": True}, temperature=0.0, logit_bias=bias):
        assert isinstance(json.loads(c.text), dict) and c.finish_reason == "stop", c.text


def test_greedy_equals_greedy_with_the_mask_applied_by_hand(llm, hf_reference):
    """The HF model's logits, masked with llguidance's own bitmask (unpacked by numpy), argmax
    each step: the engine's constrained greedy output, token for token."""
    import llguidance

    model, _ = hf_reference("opt")
    compiler = llm.engine.grammars
    eos = set(llm.engine.eos_token_ids)
    for constraint in ({"json": SCHEMA}, {"grammar": GRAMMAR}):
        params = StructuredOutputsParams(**constraint)
        for prompt in PROMPTS[:2]:
            (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, structured_outputs=params),
                                  use_tqdm=False)
            matcher = llguidance.LLMatcher(compiler.ll_tokenizer(), llguidance_grammar(params), log_level=0)
            ids, expected = list(out.prompt_token_ids), []
            while len(expected) < 64:
                with torch.no_grad():
                    logits = model(torch.tensor([ids])).logits[0, -1].numpy()
                words = np.frombuffer(matcher.compute_bitmask(), dtype="<u4")
                allowed = (words[np.arange(logits.shape[0]) // 32] >> (np.arange(logits.shape[0]) % 32)) & 1
                token = int(np.where(allowed == 1, logits, -np.inf).argmax())
                expected.append(token)
                ids.append(token)
                assert matcher.consume_token(token)
                if token in eos or matcher.is_stopped():
                    break
            assert out.outputs[0].token_ids == expected, (prompt, constraint)


def llguidance_grammar(params: StructuredOutputsParams) -> str:
    from rayserve_paged.engine.structured_outputs import grammar_text

    return grammar_text(params)


def test_n_and_best_of_are_each_valid_and_forks_keep_their_own_state(llm):
    outs = _texts(llm, {"json": SCHEMA}, prompts=PROMPTS[:2], n=3, temperature=1.0, seed=3)
    assert len(outs) == 6
    for c in outs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in outs}) > 1  # the forks sampled apart, each still valid
    for c in _texts(llm, {"grammar": GRAMMAR}, prompts=PROMPTS[:2], n=2, best_of=4, temperature=1.0, seed=5):
        assert _arith(c.text), c.text
    assert not llm.engine.structured.matchers  # every matcher left with its request


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_equal_a_roomy_engine(tiny_paths, mode):
    roomy = LLM(model=tiny_paths["opt"], max_model_len=160, num_gpu_blocks_override=64, swap_space_gb=0.01)
    tight = LLM(model=tiny_paths["opt"], max_model_len=160, num_gpu_blocks_override=10, swap_space_gb=0.05,
                preemption_mode=mode, enable_prefix_caching=False)
    prompts = ["hello world " * 6, "the cat sat on the mat " * 4, "a b c d e f g " * 4, "numbers: 1 2 3 4 5 6 7 8"]
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=11, structured_outputs={"grammar": GRAMMAR}),
        SamplingParams(max_tokens=40, temperature=1.0, seed=12, n=2, structured_outputs={"json": SCHEMA}),
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"regex": "[a-z ]{10,40}"}),
    ]
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    counters = tight.engine.scheduler.counters
    assert (counters.preemptions_swap if mode == "swap" else counters.preemptions_recompute) > 0
    assert got == expected


def test_free_rows_of_a_mixed_batch_get_the_tokens_they_get_alone(llm):
    free = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, temperature=1.0, seed=4)]
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], free, use_tqdm=False)]
    constrained = SamplingParams(max_tokens=24, temperature=1.0, seed=9, structured_outputs={"json": SCHEMA})
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]],
                         [free[0], constrained, free[1], constrained], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone


def test_max_tokens_first_ends_with_length_and_a_valid_prefix(llm):
    (c,) = _texts(llm, {"json": SCHEMA}, prompts=PROMPTS[:1], max_tokens=5, temperature=0.0)
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert c.text == '{"name'  # the schema's first key, cut by max_tokens


def test_the_grammar_decides_where_eos_may_come(llm):
    # ignore_eos off, min_tokens past the grammar's end: the grammar wins, the output is whole
    (c,) = _texts(llm, {"choice": ["yes", "no"]}, prompts=PROMPTS[:1], temperature=0.0, min_tokens=8)
    assert c.text in ("yes", "no") and c.finish_reason == "stop"


def test_a_constraint_is_compiled_once(llm):
    compiler = llm.engine.grammars
    _texts(llm, {"regex": "[0-9]{4}"}, prompts=PROMPTS[:1])
    before = compiler.num_compiles
    for c in _texts(llm, {"regex": "[0-9]{4}"}, n=2, temperature=1.0, seed=1):
        assert re.fullmatch("[0-9]{4}", c.text)
    assert compiler.num_compiles == before


@pytest.mark.parametrize(
    ("constraint", "field", "words"),
    [
        ({"json": {"type": "nope"}}, "structured_outputs.json", "Invalid type"),
        ({"json": {"type": "string", "not": {"const": "a"}}}, "structured_outputs.json", "Unimplemented keys"),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"json": {"enum": ["x" * 70_000]}}, "structured_outputs.json", "exceed the limit"),
        ({"regex": "[^\\s\\S]"}, "structured_outputs.regex", "no output can match"),
        ({"regex": "(ab"}, "structured_outputs.regex", "unclosed group"),
        ({"grammar": "start: foo"}, "structured_outputs.grammar", "unknown name"),
        ({"choice": []}, "structured_outputs.choice", "non-empty list"),
        ({"regex": "a", "choice": ["b"]}, "structured_outputs", "exactly one"),
        ({"jsn": {}}, "structured_outputs.jsn", "unknown constraint"),
    ],
)
def test_bad_constraints_are_errors_that_name_the_field(llm, constraint, field, words):
    with pytest.raises(SamplingParamsError, match=re.escape(field)) as e:
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert words in str(e.value)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured.matchers
    (ok,) = _texts(llm, {"choice": ["ok"]}, prompts=PROMPTS[:1])  # the engine goes on
    assert ok.text == "ok"


def test_beam_search_with_a_constraint_is_refused():
    with pytest.raises(SamplingParamsError, match="structured_outputs: beam search"):
        SamplingParams(use_beam_search=True, n=2, temperature=0.0, structured_outputs={"regex": "a+"})


def test_the_sampler_applies_packed_bitmasks_to_their_rows_only():
    vocab = 40
    logits = torch.randn(3, vocab)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[3, 17, 33, 39]] = True
    words = np.zeros(2, dtype=np.uint32)
    for t in (3, 17, 33, 39):
        words[t // 32] |= np.uint32(1 << (t % 32))
    bitmask = torch.from_numpy(words.view(np.int32).copy()).unsqueeze(0)  # [1, 2]
    assert (bitmask_bias(bitmask, vocab)[0] == 0).tolist() == allowed.tolist()
    assert torch.isneginf(bitmask_bias(bitmask, vocab)[0, ~allowed]).all()
    assert torch.isneginf(bitmask_bias(bitmask, 70)[0, 40:]).all()  # past the mask: not allowed

    def batch(**kw):
        return SamplingBatch((0, 1, 2), (0.0,) * 3, (-1,) * 3, (1.0,) * 3, (0.0,) * 3, (None,) * 3, (0,) * 3,
                             (0,) * 3, (1,) * 3, (0,) * 3, (None,) * 3, **kw)

    out = Sampler()(logits, batch(token_bitmask_rows=[1], token_bitmask=bitmask))
    every = Sampler()(logits[1:2], SamplingBatch((1,), (0.0,), (-1,), (1.0,), (0.0,), (None,), (0,), (0,), (1,), (0,),
                                                 (None,), token_bitmask_rows=[0], token_bitmask=bitmask))  # fmt: skip
    best_allowed = int(torch.where(allowed, logits[1], -torch.inf).argmax())
    assert [s.token_ids[0] for s in out.samples] == [int(logits[0].argmax()), best_allowed, int(logits[2].argmax())]
    assert every.samples[0].token_ids == [best_allowed]  # every row constrained: the in-place path
    hot = SamplingBatch((0, 1, 2), (0.0, 5.0, 0.0), (-1,) * 3, (1.0,) * 3, (0.0,) * 3, (None,) * 3, (0,) * 3, (0,) * 3,
                        (1,) * 3, (0,) * 3, (None,) * 3, token_bitmask_rows=[1], token_bitmask=bitmask)  # fmt: skip
    drawn = {Sampler()(logits, hot).samples[1].token_ids[0] for _ in range(40)}
    assert drawn <= {3, 17, 33, 39} and len(drawn) > 1  # sampled, only ever among the allowed
    # logprobs stay the model's own
    assert out.samples[1].logprobs[0] == pytest.approx(torch.log_softmax(logits[1], -1)[best_allowed].item())
    # banned tokens (min_tokens) give way where they are all the grammar allows
    out = Sampler()(logits, batch(token_bitmask_rows=[1], token_bitmask=bitmask, banned_tokens={1: [3, 17, 33, 39]}))
    assert out.samples[1].token_ids[0] == best_allowed
    out = Sampler()(logits, batch(token_bitmask_rows=[1], token_bitmask=bitmask, banned_tokens={1: [best_allowed]}))
    assert out.samples[1].token_ids[0] != best_allowed and allowed[out.samples[1].token_ids[0]]


def test_the_scheduler_actor_compiles_off_the_step_loop(tiny_paths):
    """A constrained request waits for its grammar outside the step loop: a slow compile
    runs past the limit (the caller's 400) while a free request keeps stepping; a bad
    grammar is the caller's error; a good one is served."""
    import asyncio
    import threading

    from rayserve_paged.config import EngineConfig
    from rayserve_paged.engine.scheduler_actor import SchedulerActor

    config = EngineConfig(model=tiny_paths["opt"], max_model_len=128, num_gpu_blocks_override=32, swap_space_gb=0.01)
    actor = SchedulerActor(config, executor="in-process")
    engine = actor.engine
    release = threading.Event()
    real = engine.grammars._compile

    def slow(constraint):
        if constraint.regex == "slow":
            release.wait(10)
        return real(constraint)

    engine.grammars._compile = slow
    engine.grammars.timeout_s = 0.5

    async def main():
        stream = actor.outputs()
        await actor.add_request("free", None, [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0))
        with pytest.raises(SamplingParamsError, match=r"structured_outputs.regex: compiling took longer than 0.5 s"):
            await actor.add_request("slow", None, [5, 6], SamplingParams(structured_outputs={"regex": "slow"}))
        with pytest.raises(SamplingParamsError, match="structured_outputs.grammar: .*unknown name"):
            await actor.add_request("bad", None, [5, 6], SamplingParams(structured_outputs={"grammar": "start: x"}))
        await actor.add_request("ok", None, [5, 6], SamplingParams(structured_outputs={"choice": ["yes", "no"]}))
        release.set()
        steps_of_free, finished, texts = 0, set(), {}
        while finished != {"free", "ok"}:
            for out in await anext(stream):
                if out.request_id == "free":
                    steps_of_free += 1
                texts.setdefault(out.request_id, []).extend(t for d in out.outputs for t in d.token_ids)
                if out.finished:
                    finished.add(out.request_id)
        assert steps_of_free >= 1 and len(texts["free"]) == 30
        assert engine.tokenizer.decode(texts["ok"]) in ("yes", "no")

    try:
        asyncio.run(main())
    finally:
        actor.shutdown()
    assert not engine.structured.matchers


def test_the_engine_loads_its_tokenizer_only_for_a_request_that_needs_it(tiny_paths, llm):
    """Token-id requests (what a Serve replica sends) leave the engine's tokenizer unloaded;
    a grammar loads it (in the compile thread) and a text prompt uses it: the tokens are
    those of an engine built with its tokenizer."""
    from transformers import AutoTokenizer

    from rayserve_paged.config import EngineConfig
    from rayserve_paged.engine.llm_engine import LLMEngine

    config = EngineConfig(model=tiny_paths["opt"], max_model_len=256, num_gpu_blocks_override=64, swap_space_gb=0.01)
    engine = LLMEngine(config)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    prompt_ids = AutoTokenizer.from_pretrained(tiny_paths["opt"])(PROMPTS[1]).input_ids

    def run(request_id, prompt, params, ids=None):
        engine.add_request(request_id, prompt, params, ids, grammar=engine.compile_constraint(params))
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += [t for d in out.outputs for t in d.token_ids]
        return tokens

    expected = llm.generate([{"prompt_token_ids": prompt_ids}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert run("ids", None, greedy, prompt_ids) == list(expected)
    assert engine._tokenizer is None
    choice = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs={"choice": ["yes", "no"]})
    chosen = run("grammar", None, choice, prompt_ids)
    assert engine._tokenizer is not None  # the compile loaded it
    assert engine.tokenizer.decode(chosen) in ("yes", "no")
    assert run("text", PROMPTS[1], greedy) == list(expected)
