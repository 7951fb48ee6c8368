"""Constraints at the grammar's limits over HTTP: refused with a 400 naming the field the
client wrote, or ended visibly (finish_reason "abort", stop_reason "grammar_error: ...");
never a 5xx, never a 200 whose invalid output says "stop" or "length"."""

from __future__ import annotations

import json

import pytest

from rayserve_paged.core.sequence import MAX_SCHEMA_DEPTH, is_grammar_error
from tests.deployments.conftest import MODEL, assert_openai_error, parse_sse

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "Go"}]
RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
             "$ref": "#/$defs/n"}  # fmt: skip


DEEP = "__deep__"  # where a body holds the deep schema (written as text: json.dumps would recurse)


def _deep_text(levels: int) -> str:
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


def _tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


async def _post(http, route: str, body: dict, deep: str = ""):
    content = json.dumps(body).replace(json.dumps(DEEP), deep)
    return await http.post(route, content=content, headers={"content-type": "application/json"})


async def test_schemas_nested_past_the_limit_are_400s_wherever_they_come(http):
    # the deepest body the parser takes (its limit depends on the stack it runs on): up to
    # ~950 levels, which the old code failed to re-encode (a 500)
    for levels in range(475, 50, -25):
        deep = _deep_text(levels)
        probe = await _post(http, "/v1/completions", {"model": MODEL, "prompt": "Go", "guided_json": DEEP}, deep)
        if "invalid JSON body" not in probe.text:
            break
    assert levels > MAX_SCHEMA_DEPTH
    cases = [
        ("/v1/completions", {"prompt": "Go", "guided_json": DEEP}, "guided_json"),
        ("/v1/completions", {"prompt": "Go", "structured_outputs": {"json": DEEP}}, "structured_outputs.json"),
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": DEEP}}}, "response_format.json_schema.schema"),  # fmt: skip
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": _tool(DEEP), "tool_choice": "required"}, None),
    ]
    for route, extra, param in cases:
        for stream in (False, True):
            response = await _post(http, route, {"model": MODEL, "max_tokens": 4, "stream": stream, **extra}, deep)
            error = assert_openai_error(response, 400, param)
            assert "nests" in error["message"] and f"limit of {MAX_SCHEMA_DEPTH}" in error["message"], error
    for extra in ({"tools": _tool(DEEP), "tool_choice": "auto"}, {"tools": _tool(DEEP)}):  # only rendered
        response = await _post(http, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                              **extra}, deep)  # fmt: skip
        assert response.status_code in (200, 400), response.text
    ok = await _post(http, "/v1/completions", {"model": MODEL, "prompt": "Go", "guided_choice": ["fine"]})
    assert ok.json()["choices"][0]["text"] == "fine"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": RECURSIVE}, "guided_json"),
        ({"structured_outputs": {"grammar": 'start: "a" start'}}, "structured_outputs.grammar"),
        ({"guided_grammar": 'root ::= "x" root'}, "guided_grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": RECURSIVE}}},
         "response_format.json_schema.schema"),  # fmt: skip
    ],
)
async def test_constraints_that_can_never_finish_are_400s(http, extra, param):
    route, body = ("/v1/chat/completions", {"messages": MESSAGES}) if "response_format" in extra else (
        "/v1/completions", {"prompt": "Go"})  # fmt: skip
    for stream in (False, True):
        response = await _post(http, route, {"model": MODEL, "max_tokens": 8, "stream": stream, **body, **extra})
        assert_openai_error(response, 400, param, "refused, its first token already runs past the grammar limits")


async def test_a_grammar_error_mid_generation_ends_the_choice_visibly(http, engine):
    """The nested repeats compile; the lexer runs out of room ~20 'a's in. The old code
    answered 200, finish_reason "stop" (an EOS-only mask)."""
    a = engine.tokenizer.convert_tokens_to_ids("a")
    body = {"model": MODEL, "prompt": "Go", "max_tokens": 60, "temperature": 0, "logit_bias": {str(a): 50},
            "guided_regex": "^((a{1,100}){1,100}){1,100}$"}  # fmt: skip
    response = await _post(http, "/v1/completions", body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "abort" and is_grammar_error(choice["stop_reason"]), choice
    assert choice["text"] and set(choice["text"]) == {"a"}
    events = parse_sse(await _post(http, "/v1/completions", {**body, "stream": True}))
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == choice["text"]
    assert [(c["finish_reason"], c["stop_reason"]) for c in choices if c["finish_reason"]] == [
        ("abort", choice["stop_reason"])]  # fmt: skip
    chat = await _post(http, "/v1/chat/completions", {**body, "messages": MESSAGES, "prompt": None})
    (chat_choice,) = chat.json()["choices"]
    assert chat_choice["finish_reason"] == "abort" and is_grammar_error(chat_choice["stop_reason"]), chat_choice
    ok = await _post(http, "/v1/completions", {"model": MODEL, "prompt": "Go", "guided_choice": ["fine"]})
    assert ok.json()["choices"][0]["text"] == "fine"


async def test_vllm_json_options_are_honoured_or_refused(http):
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "boolean"}},
              "required": ["k", "v"]}  # fmt: skip
    body = {"model": MODEL, "prompt": "Go", "max_tokens": 30, "temperature": 0}
    options = {"json": schema, "disable_any_whitespace": True, "disable_additional_properties": True}
    response = await _post(http, "/v1/completions", {**body, "structured_outputs": options})
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "stop" and " " not in choice["text"], choice
    assert set(json.loads(choice["text"])) == {"k", "v"}
    response = await _post(http, "/v1/completions", {**body, "structured_outputs": {"regex": "a+",
                                                                                    "disable_any_whitespace": True}})
    assert_openai_error(response, 400, "structured_outputs.disable_any_whitespace", "applies to a JSON constraint")
