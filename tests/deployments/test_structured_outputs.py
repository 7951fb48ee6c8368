"""response_format, vLLM's constraint fields and tool calls over HTTP, with the official
openai client. The tiny model has random weights: only the constraint makes outputs valid."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from rayserve_paged.deployments.openai_ingress import create_openai_app
from tests.deployments.conftest import MODEL, assert_openai_error, parse_sse

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "Weather?"}]
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
WEATHER = {
    "type": "object",
    "properties": {"city": CITY, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)
    rain: bool


@pytest.fixture
async def client(app):
    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=transport) as c:
        yield c


async def test_parse_with_a_pydantic_model_returns_the_object(client):
    for seed in (1, 2, 3):
        chat = await client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, response_format=Forecast, max_tokens=60, temperature=1.0, seed=seed
        )
        parsed = chat.choices[0].message.parsed
        assert isinstance(parsed, Forecast), chat.choices[0].message.content
        assert chat.choices[0].finish_reason == "stop"


async def test_response_format_json_object_and_schema_on_both_routes(http, engine):
    bias = {str(engine.tokenizer.convert_tokens_to_ids(t)): 30 for t in ('"', "}")}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "logit_bias": bias,
            "response_format": {"type": "json_object"}}  # fmt: skip
    text = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["content"]
    assert isinstance(json.loads(text), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    for route, extra in (("/v1/completions", {"prompt": "Weather:"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        response = await http.post(route, json={"model": MODEL, "max_tokens": 40, "n": 2, "temperature": 1.0,
                                                "seed": 5, "response_format": fmt, **extra})  # fmt: skip
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            jsonschema.validate(json.loads(text), WEATHER)


async def test_vllm_constraint_fields(http):
    cases = [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"json": WEATHER}}, lambda t: jsonschema.validate(json.loads(t), WEATHER) is None),
        ({"guided_json": json.dumps(TIME)}, lambda t: jsonschema.validate(json.loads(t), TIME) is None),
        ({"guided_regex": "(ab)+c"}, lambda t: re.fullmatch("(ab)+c", t)),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_grammar": 'start: "x" /[0-9]/ "y"'}, lambda t: re.fullmatch("x[0-9]y", t)),
    ]
    for extra, valid in cases:
        body = {"model": MODEL, "prompt": "Go:", "max_tokens": 40, "temperature": 1.0, "seed": 2, "n": 2, **extra}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, (extra, response.text)
        for choice in response.json()["choices"]:
            assert valid(choice["text"]), (extra, choice["text"])


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema", "Invalid type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
         "response_format.json_schema.schema", "Unimplemented keys"),
        ({"guided_json": {"enum": ["x" * 70_000]}}, "guided_json", "exceed the limit"),
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "no output can match"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "invalid regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "cannot be combined"),
        ({"response_format": {"type": "xml"}}, "response_format.type", None),
        ({"use_beam_search": True, "n": 2, "temperature": 0, "guided_regex": "a+"}, "guided_regex", "beam search"),
        ({"guided_choice": ["ok", "\ud800"]}, "guided_choice", "lone surrogate U+D800"),
        ({"guided_json": {"enum": ["\udfff"]}}, "guided_json", "lone surrogate U+DFFF"),
        ({"guided_json": {"type": "array", "items": {"$ref": "#/nope"}}}, "guided_json", "does not exist"),
        ({"guided_json": {"type": "string", "pattern": "(?=a)"}}, "guided_json", "look-around"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ],
)
async def test_bad_constraints_are_400s_naming_the_field(http, extra, param, words):
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "Go:", "max_tokens": 8, "stream": stream, **extra}
        if stream and extra.get("use_beam_search"):
            continue  # streaming beam search is its own 400
        # json.dumps escapes a lone surrogate as JSON may ("\ud800"); httpx's json= cannot encode it
        response = await http.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
        error = assert_openai_error(response, 400, param)
        if words is not None:
            assert words in error["message"], error
    ok = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Go:", "guided_choice": ["fine"]})
    assert ok.json()["choices"][0]["text"] == "fine"  # the server goes on serving


async def test_tool_choice_required_and_named_plain_and_streamed(client):
    for seed in (1, 2):
        chat = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=1.0,
            seed=seed, extra_body={"parallel_tool_calls": False},
        )
        (choice,) = chat.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    chat = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=40, temperature=0
    )
    (call,) = chat.choices[0].message.tool_calls
    assert call.function.name == "get_time" and chat.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    # streamed: the client's stream helper assembles the same calls
    for tool_choice in (named, "required"):
        async with client.chat.completions.stream(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0
        ) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_completion()
        plain = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0
        )
        got = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
        assert got == [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]
        assert final.choices[0].finish_reason == "tool_calls"
        for name, arguments in got:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def test_stream_chunks_carry_delta_tool_calls_in_openai_format(http):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, "temperature": 0, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    events = parse_sse(await http.post("/v1/chat/completions", json=body))
    calls = [e["choices"][0]["delta"]["tool_calls"] for e in events if e["choices"][0]["delta"].get("tool_calls")]
    first = calls[0][0]
    assert set(first) == {"index", "id", "type", "function"} and first["function"]["name"] == "get_weather"
    assert all(set(c[0]) == {"index", "function"} and set(c[0]["function"]) == {"arguments"} for c in calls[1:])
    jsonschema.validate(json.loads("".join(c[0]["function"]["arguments"] for c in calls)), WEATHER)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_auto_with_the_hermes_parser_on_a_scripted_output(hermes_http):
    script = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}</tool_call>'
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 80,
            "structured_outputs": {"choice": [script]}}  # fmt: skip
    choice = (await hermes_http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "c"}'}
    events = parse_sse(await hermes_http.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events]
    head, *arguments = [c for d in deltas for c in d.get("tool_calls", [])]  # the name first, then the arguments
    assert head["function"] == {"name": "get_weather", "arguments": ""} and head["index"] == 0
    assert "".join(a["function"]["arguments"] for a in arguments) == call["function"]["arguments"]
    assert "".join(d.get("content", "") for d in deltas) == "Let me look."  # sent before the call began
    assert len([d for d in deltas if d.get("content")]) > 1  # as it came, not at the end
    # plain text is content, finish_reason unchanged
    body["structured_outputs"] = {"choice": ["no tools needed"]}
    choice = (await hermes_http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "no tools needed"}
    assert choice["finish_reason"] == "stop"
    events = parse_sse(await hermes_http.post("/v1/chat/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "no tools needed"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_tool_results_continue_through_the_template(hermes_app):
    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=hermes_app), base_url="http://test")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=transport)
    turns = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 20 C"},
    ]  # fmt: skip
    chat = await client.chat.completions.create(
        model=MODEL, messages=turns, tools=TOOLS, max_tokens=5, temperature=0, extra_body={"guided_choice": ["ok"]}
    )
    assert chat.choices[0].message.content == "ok"
    await client.close()


async def test_bad_tool_choices_are_400s(http):
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "use_beam_search": True, "n": 2, "temperature": 0}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          "tool_choice": "required"}, "tools"),
    ]
    for extra, param in cases:
        assert_openai_error(await http.post("/v1/chat/completions", json={**base, **extra}), 400, param)
