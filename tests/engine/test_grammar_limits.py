"""Constraints at llguidance's limits and the engine's budgets: a grammar that cannot go on
ends its sequence with finish_reason "abort" and a stop_reason naming the grammar error
(never an unconstrained run, never a fake "stop"); a constraint that can never finish is
refused when it compiles; the step thread never compiles. The tiny model has random
weights: a logit bias steers it where a test needs it to go."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import jsonschema
import pytest

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.core.sequence import (
    MAX_SCHEMA_DEPTH,
    SamplingParamsError,
    StructuredOutputsParams,
    is_grammar_error,
)

RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
             "$ref": "#/$defs/n"}  # fmt: skip
NESTED_REPEATS = "^((a{1,100}){1,100}){1,100}$"


@pytest.fixture(scope="module")
def llm(tiny_paths):
    return LLM(model=tiny_paths["opt"], max_model_len=256, num_gpu_blocks_override=64, swap_space_gb=0.01)


def _bias(llm, *tokens: str, value: float = 50.0) -> dict[int, float]:
    tok = llm.get_tokenizer()
    return {tok.convert_tokens_to_ids(t): value for t in tokens}


def _one(llm, constraint, **params):
    params.setdefault("max_tokens", 120)
    params.setdefault("temperature", 0.0)
    (out,) = llm.generate(["hello"], SamplingParams(structured_outputs=constraint, **params), use_tqdm=False)
    return out.outputs


def _nested(depth: int) -> dict:
    """A schema whose JSON text nests `depth` levels (2 per object level)."""
    schema: dict = {"type": "string", "maxLength": 2}
    while True:
        wrapped = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        if json_depth(wrapped) > depth:
            return schema
        schema = wrapped


def json_depth(value) -> int:
    from rayserve_paged.core.sequence import json_depth as depth

    return depth(value)


@pytest.mark.parametrize(
    "constraint",
    [{"json": RECURSIVE}, {"grammar": 'start: "a" start'}, {"grammar": 'root ::= "x" root'},
     {"regex": "m0(a{1000}){1000}"}],  # fmt: skip
    ids=["required-recursion", "lark-no-finite-sentence", "gbnf-no-finite-sentence", "huge-repeat"],
)
def test_constraints_that_can_never_finish_are_refused_when_compiled(llm, constraint):
    kind = next(iter(constraint))
    with pytest.raises(SamplingParamsError, match=f"structured_outputs.{kind}: refused, its first token") as e:
        _one(llm, constraint)
    assert "grammar limits" in str(e.value)
    assert llm.engine.grammars.cached(StructuredOutputsParams(**constraint)) is None  # a failure is not cached
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured.matchers
    (ok,) = _one(llm, {"choice": ["ok"]})  # the engine goes on
    assert ok.text == "ok" and ok.finish_reason == "stop"


def test_a_limit_hit_at_the_mask_ends_the_sequence_with_a_grammar_error(llm):
    """The nested repeats compile and start; some 20 'a's in, the lexer runs out of room
    while computing the next mask. The old code answered an EOS-only mask: 'stop'."""
    errors = llm.engine.structured.errors
    before = errors.mask
    (c,) = _one(llm, {"regex": NESTED_REPEATS}, logit_bias=_bias(llm, "a"))
    assert c.finish_reason == "abort" and is_grammar_error(c.stop_reason), (c.finish_reason, c.stop_reason)
    assert "too many expressions" in c.stop_reason
    assert c.text and set(c.text) == {"a"} and len(c.token_ids) < 120  # what it wrote met the constraint
    assert errors.mask == before + 1
    assert not llm.engine.structured.matchers


def test_a_grammar_that_cannot_go_on_after_a_sampled_token_ends_with_a_grammar_error(llm):
    """A string or the required recursion: the first mask allows both; the model, biased to
    '{', takes the recursion, whose continuation runs into a limit (the parser's items, or
    the mask budget: whichever comes first). The old code deleted the matcher and ran on
    unconstrained, or answered an EOS-only mask as 'stop'."""
    schema = {"$defs": RECURSIVE["$defs"], "anyOf": [{"type": "string", "maxLength": 3}, {"$ref": "#/$defs/n"}]}
    errors = llm.engine.structured.errors
    before = sum(n for _, n in errors.items())
    for n in (1, 2):
        outs = _one(llm, {"json": schema}, logit_bias=_bias(llm, "{"), n=n, temperature=1.0 if n > 1 else 0.0, seed=3)
        for c in outs:
            assert c.finish_reason == "abort" and is_grammar_error(c.stop_reason), (c.text, c.stop_reason)
            assert c.text and '{"c": {"c": {"c": '.startswith(c.text), c.text  # what it wrote met the constraint
    assert sum(n for _, n in errors.items()) == before + 3
    for c in _one(llm, {"json": schema}, logit_bias=_bias(llm, '"', value=20.0)):  # the string branch is fine
        assert c.finish_reason == "stop" and isinstance(json.loads(c.text), str)


def test_a_refused_token_is_a_grammar_error_and_never_completion(llm):
    """What the matcher reports when it refuses a token (a limit at consume): an error,
    the matcher dropped, and is_stopped() after it not taken for a complete output."""
    structured = llm.engine.structured
    tok = llm.get_tokenizer()
    grammar = llm.engine.compile_constraint(SamplingParams(structured_outputs={"choice": ["yes"]}))
    before = structured.errors.consume
    structured.add(-1, grammar.new_matcher())
    is_complete, error = structured.accept(-1, tok.convert_tokens_to_ids("z"))
    assert (is_complete, is_grammar_error(error)) == (False, True) and -1 not in structured.matchers
    assert structured.errors.consume == before + 1
    structured.add(-2, grammar.new_matcher())
    for token in tok("yes", add_special_tokens=False).input_ids:
        is_complete, error = structured.accept(-2, token)
        assert error is None
    assert is_complete
    structured.remove(-2)


def test_masks_past_the_budget_end_the_sequence_with_a_grammar_error(llm):
    structured = llm.engine.structured
    budget, before = structured.mask_budget_s, structured.errors.mask_budget
    structured.mask_budget_s = 1e-9  # every mask costs more
    try:
        (c,) = _one(llm, {"regex": "[a-z]{30}"})
    finally:
        structured.mask_budget_s = budget
    assert c.finish_reason == "abort" and "past the budget" in c.stop_reason and c.token_ids == []
    assert structured.errors.mask_budget == before + 1
    (ok,) = _one(llm, {"regex": "[a-z]{30}"})  # at the real budget a benign regex runs to its end
    assert ok.finish_reason == "stop" and len(ok.text) == 30


def test_schemas_nested_past_the_limit_are_refused_before_any_reencoding(llm):
    for depth in (MAX_SCHEMA_DEPTH + 1, 950):
        schema = _nested(depth)
        for given in (schema, json.dumps(schema)):
            with pytest.raises(SamplingParamsError, match="structured_outputs.json: the schema nests"):
                SamplingParams(structured_outputs={"json": given})
    at_limit = _nested(MAX_SCHEMA_DEPTH)
    assert json_depth(at_limit) in (MAX_SCHEMA_DEPTH - 1, MAX_SCHEMA_DEPTH)
    params = SamplingParams(max_tokens=400, temperature=0.0, structured_outputs={"json": at_limit})
    assert llm.engine.compile_constraint(params) is not None  # below llguidance's own limit (128)


def test_vllm_json_options_are_honoured_and_refused_elsewhere(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"enum": ["x", "y"]}}, "required": ["a", "b"],
              "additionalProperties": False}  # fmt: skip
    (spaced,) = _one(llm, {"json": schema})
    (compact,) = _one(llm, {"json": schema, "disable_any_whitespace": True})
    assert spaced.text.startswith('{"a": ') and ", " in spaced.text, spaced.text
    assert compact.text.startswith('{"a":') and " " not in compact.text and compact.finish_reason == "stop"
    jsonschema.validate(json.loads(compact.text), schema)
    # disable_additional_properties: only the declared keys (the random model, biased to ',',
    # would add more: an open object lets it)
    open_schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    strict = {**open_schema, "additionalProperties": False}
    params = StructuredOutputsParams(json=open_schema, disable_additional_properties=True)
    assert json.loads(params.json) == strict
    for c in _one(llm, {"json": open_schema, "disable_additional_properties": True}, n=3, temperature=1.0, seed=4,
                  logit_bias=_bias(llm, ",", value=5.0)):  # fmt: skip
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), strict)
    for name in ("disable_any_whitespace", "disable_additional_properties"):
        with pytest.raises(SamplingParamsError, match=f"structured_outputs.{name}: applies to a JSON constraint"):
            SamplingParams(structured_outputs={"regex": "a+", name: True})
        with pytest.raises(SamplingParamsError, match=f"structured_outputs.{name}: must be true or false"):
            SamplingParams(structured_outputs={"json_object": True, name: "yes"})


def test_the_step_thread_never_compiles_and_never_stalls_on_a_compile(tiny_paths):
    """A one-entry cache churned by distinct constraints compiled two at a time, each
    compile slowed to 1 s, while a free stream runs: every grammar compiles on a compile
    thread, never on the step thread, every constrained output meets its regex, and the
    free stream's tokens keep coming (the old code looked the grammar up again on the step
    thread, found it evicted and compiled it there: the whole replica stalled >= 1 s)."""
    from rayserve_paged.config import EngineConfig
    from rayserve_paged.engine.scheduler_actor import SchedulerActor

    config = EngineConfig(model=tiny_paths["opt"], max_model_len=1024, num_gpu_blocks_override=160,
                          swap_space_gb=0.01)  # fmt: skip
    actor = SchedulerActor(config, executor="in-process")
    engine = actor.engine
    grammars = engine.grammars
    grammars.cache_size = 1
    compiled_on: list[int] = []
    real = grammars._compile

    def slow(constraint):
        compiled_on.append(threading.get_ident())
        time.sleep(1.0)
        return real(constraint)

    grammars._compile = slow
    regexes = [f"{c}[0-9]{{2}}" for c in "pqrs"]

    async def main():
        stream = actor.outputs()
        arrivals, texts, finished = [], {}, set()
        wanted = {f"c{i}" for i in range(len(regexes))}
        free = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        streams = ["free0"]  # free requests, one after the other while the constrained ones wait

        async def read():
            while not wanted <= finished:
                for out in await anext(stream):
                    if out.request_id.startswith("free") and out.outputs and out.outputs[0].token_ids:
                        arrivals.append(time.monotonic())
                    texts.setdefault(out.request_id, []).extend(t for d in out.outputs for t in d.token_ids)
                    if out.finished:
                        finished.add(out.request_id)
                if streams[-1] in finished:
                    streams.append(f"free{len(streams)}")
                    await actor.add_request(streams[-1], None, [5, 6, 7], free)

        await actor.add_request(streams[0], None, [5, 6, 7], free)
        reader = asyncio.create_task(read())
        await asyncio.gather(*[
            actor.add_request(f"c{i}", None, [5, 6], SamplingParams(max_tokens=8, structured_outputs={"regex": r}))
            for i, r in enumerate(regexes)
        ])  # fmt: skip
        await reader
        await actor.abort(streams[-1])
        return arrivals, texts, time.monotonic()

    try:
        start = time.monotonic()
        arrivals, texts, end = asyncio.run(main())
    finally:
        actor.shutdown()
    assert len(compiled_on) >= len(regexes) and actor._thread.ident not in compiled_on
    for i, regex in enumerate(regexes):
        text = engine.tokenizer.decode(texts[f"c{i}"])
        assert len(text) == 3 and text[0] == regex[0] and text[1:].isdigit(), text
    during = [t for t in arrivals if start <= t <= end]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert end - start > 1.5 and len(during) > 20
    assert max(gaps) < 0.5, max(gaps)  # each compile takes 1 s


def _compiler(llm, **options):
    from rayserve_paged.engine.structured_outputs import GrammarCompiler

    engine = llm.engine
    return GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, tuple(engine.eos_token_ids), **options)


def test_a_compile_past_the_timeout_is_abandoned_and_gives_its_thread_up(llm):
    """Two compiles that run past the timeout take both compile places; abandoned, they
    give them up, so the next request's cheap constraint compiles at once (the old pool
    kept both threads until the slow compiles ended: the cheap one timed out too)."""
    compiler = _compiler(llm, timeout_s=0.5, max_workers=2, max_abandoned=2)
    release = threading.Event()
    real = compiler._compile

    def slow(constraint):
        if constraint.regex.startswith("slow"):
            release.wait(30)
        return real(constraint)

    compiler._compile = slow
    try:
        for regex in ("slow1", "slow2"):
            with pytest.raises(SamplingParamsError, match="structured_outputs.regex: compiling took longer than 0.5 s"):
                compiler.compile(StructuredOutputsParams(regex=regex))
        assert (compiler.threads.num_active, compiler.threads.num_abandoned) == (0, 2)
        fast = compiler.compile(StructuredOutputsParams(regex="[0-9]{3}"))  # within the timeout
        assert fast.new_matcher() is not None
        for regex in ("slow1", "slow2"):  # timed out: not cached
            assert compiler.cached(StructuredOutputsParams(regex=regex)) is None
    finally:
        release.set()
        compiler.shutdown()


def test_the_cache_is_bounded_by_bytes_and_keeps_no_failure(llm):
    compiler = _compiler(llm)
    try:
        first, second = (StructuredOutputsParams(regex=r) for r in ("[a-c]{4}", "[d-f]{5}"))
        compiler.compile(first)
        compiler.compile(second)
        assert compiler.cached(first) is not None and compiler.cached(second) is not None
        held = compiler.num_cached_bytes
        assert held >= first.num_chars + second.num_chars
        compiler.cache_bytes = held  # room for these two: the third sends the least recently used out
        third = StructuredOutputsParams(regex="[g-i]{6}")
        compiler.compile(third)
        assert compiler.cached(first) is None and compiler.cached(third) is not None
        assert compiler.num_cached_bytes <= compiler.cache_bytes or len(compiler._cache) == 1
        bad = StructuredOutputsParams(grammar="start: nowhere")
        with pytest.raises(SamplingParamsError, match="unknown name"):
            compiler.compile(bad)
        assert compiler.cached(bad) is None and bad.cache_key not in compiler._cache
    finally:
        compiler.shutdown()
