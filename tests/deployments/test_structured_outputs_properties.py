"""Drawn JSON schemas (nested objects, arrays, enums, patterns, $ref, anyOf, bounded numbers
and string lengths) and drawn requests (n, temperature, seed) over HTTP, three at a time
beside two free ones on an engine whose KV pool holds about one of them, so requests are
preempted (recompute for one sequence, swap for two): every choice that ends "stop" meets its schema; "length" only
where max_tokens cut it; the rest is the grammar-error outcome or a 400; never a 5xx, and
the engine ends idle with every block free."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.sequence import is_grammar_error
from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.engine.llm_engine import LLMEngine
from tests.deployments.conftest import MODEL, asgi_client, idle_client

MAX_TOKENS = 48
# beside the drawn requests, free ones that run to max_tokens: one of two sequences (its
# group is preempted to recompute) and one of one (swapped: a group of two)
FILLERS = [{"n": 2, "temperature": 0.8, "seed": 1}, {"n": 1, "temperature": 0.0}]

_NAMES = st.sampled_from(["a", "b", "id", "x_1"])
_LEAVES = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),  # fmt: skip
    st.builds(lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
              st.integers(-5, 5), st.integers(1, 10)),  # fmt: skip
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 3), st.integers(0, 4)),  # fmt: skip
    st.sampled_from([{"type": "string", "pattern": "^[a-z]{1,4}$"}, {"type": "string", "pattern": "^[0-9]{2}-[A-Z]$"}]),
    st.lists(st.sampled_from(["red", "7", "x y", "é"]), min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"const": "k"}]),
)


def _object(props: dict) -> st.SearchStrategy:
    required = st.lists(st.sampled_from(sorted(props)), unique=True)
    return required.map(lambda req: {"type": "object", "properties": props, "required": req,
                                     "additionalProperties": False})  # fmt: skip


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.dictionaries(_NAMES, children, min_size=1, max_size=3).flatmap(_object),
        st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most}, children, st.integers(0, 3)),
        st.lists(children, min_size=2, max_size=2).map(lambda alternatives: {"anyOf": alternatives}),
    )


_SCHEMAS = st.recursive(_LEAVES, _containers, max_leaves=5)
SCHEMAS = st.one_of(
    _SCHEMAS,
    _SCHEMAS.map(lambda defined: {"$defs": {"d": defined}, "type": "object", "properties": {"v": {"$ref": "#/$defs/d"}},
                                  "required": ["v"], "additionalProperties": False}),  # fmt: skip
)
REQUESTS = st.one_of(
    st.just({"n": 1, "temperature": 0.0}),
    st.fixed_dictionaries({"n": st.sampled_from([1, 2]), "temperature": st.just(0.8), "seed": st.integers(0, 2**16)}),
)


_PROPERTY_RAN_ON: set[int] = set()  # the engines (ids) the property test has run on


@pytest.fixture(scope="module")
def tight_engine(tiny_opt_path) -> LLMEngine:
    """Four blocks of 16 tokens: one request of 64 tokens, far less than five of them."""
    config = EngineConfig(model=tiny_opt_path, device="cpu", max_model_len=64, num_gpu_blocks_override=4,
                          swap_space_gb=0.01, preemption_mode="auto", max_num_seqs=8)  # fmt: skip
    return LLMEngine(config)


async def _serve(engine, schema: dict, requests: list[dict]) -> list:
    async with idle_client(engine) as client, asgi_client(create_openai_app(client, engine.tokenizer, MODEL)) as http:
        bodies = [{"model": MODEL, "prompt": f"Item {i}:", "max_tokens": MAX_TOKENS, "guided_json": schema, **r}
                  for i, r in enumerate(requests)]  # fmt: skip
        bodies += [{"model": MODEL, "prompt": "Free:", "max_tokens": MAX_TOKENS, "ignore_eos": True, **r}
                   for r in FILLERS]  # fmt: skip
        responses = await asyncio.gather(*[http.post("/v1/completions", json=b) for b in bodies])
    for response in responses[len(requests):]:
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= MAX_TOKENS
    return responses[: len(requests)]


@settings(max_examples=6, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(schema=SCHEMAS, requests=st.lists(REQUESTS, min_size=3, max_size=3))
def test_every_stopped_output_meets_its_schema_under_preemption(tight_engine, schema, requests):
    _PROPERTY_RAN_ON.add(id(tight_engine))
    responses = asyncio.run(_serve(tight_engine, schema, requests))
    for response, request in zip(responses, requests):
        assert response.status_code in (200, 400), response.text
        if response.status_code == 400:
            assert response.json()["error"]["param"] == "guided_json", response.text
            continue
        body = response.json()
        assert len(body["choices"]) == request["n"]
        for choice in body["choices"]:
            reason = choice["finish_reason"]
            if reason == "stop":
                jsonschema.validate(json.loads(choice["text"]), schema)
            elif reason == "length":
                assert body["usage"]["completion_tokens"] >= MAX_TOKENS, body  # cut by max_tokens
            else:
                assert reason == "abort" and is_grammar_error(choice["stop_reason"]), choice


def test_the_drawn_requests_were_preempted_both_ways(tight_engine):
    """The property above ran on a pool that forced both preemption modes (in file order it
    has run on this module's engine; in another order it runs here first)."""
    if id(tight_engine) not in _PROPERTY_RAN_ON:
        test_every_stopped_output_meets_its_schema_under_preemption(tight_engine)
    counters = tight_engine.scheduler.counters
    assert counters.preemptions_recompute > 0 and counters.preemptions_swap > 0, counters
