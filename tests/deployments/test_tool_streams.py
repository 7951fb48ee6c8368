"""Tool calls streamed as OpenAI streams them, and the parsers' checks, over the served app
with the official openai client's stream helper. Forced calls ("required", named) come from
the tiny model under the constraint; "auto" outputs are scripted with a choice constraint
(the tiny model has random weights) and read by the deployment's parser."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from rayserve_paged.deployments.openai_ingress import create_openai_app
from tests.deployments.conftest import MODEL, asgi_client, assert_openai_error, parse_sse
from tests.deployments.test_structured_outputs import MESSAGES, SCHEMAS, TOOLS

pytestmark = pytest.mark.anyio

NAMED = {"type": "function", "function": {"name": "get_weather"}}
ONE_CALL = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}</tool_call>'
TWO_CALLS = ('<tool_call>{"name":"get_time","arguments":{"zone":"CET"}}</tool_call>\n'
             '<tool_call>{"name":"get_time","arguments":{"zone":"UTC"}}</tool_call> Done.')  # fmt: skip
MAX_TOKENS = 116  # the whole script (111 tokens) within the tiny engine's 128-token context


def openai_client(app) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=asgi_client(app))


@pytest.fixture
async def client(app):
    async with openai_client(app) as c:
        yield c


@pytest.fixture
async def hermes_client(hermes_app):
    async with openai_client(hermes_app) as c:
        yield c


async def streamed_and_plain(client, **request):
    """(every arguments.done event, the stream helper's final choice, the plain choice). The
    helpers of the installed openai client: chat.completions.stream, and
    beta.chat.completions.stream where the version still has it (each must agree)."""
    beta = getattr(getattr(client, "beta", None), "chat", None)
    helpers = [client.chat.completions.stream] + ([beta.completions.stream] if beta is not None else [])
    answers = []
    for helper in helpers:
        done = []
        async with helper(model=MODEL, messages=MESSAGES, tools=TOOLS, **request) as stream:
            async for event in stream:
                if event.type == "tool_calls.function.arguments.done":
                    done.append((event.index, event.name, event.arguments))
            final = (await stream.get_final_completion()).choices[0]
        answers.append((done, calls_of(final), final.message.content, final.finish_reason))
    assert all(a == answers[0] for a in answers)
    plain = (await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, **request)).choices[0]
    return done, final, plain


def calls_of(choice) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


@pytest.mark.parametrize(
    ("tool_choice", "extra", "num_calls"),
    [
        ("required", {"temperature": 0}, 1),
        ("required", {"temperature": 1.0, "seed": 3}, 2),  # this seed writes two calls
        (NAMED, {"temperature": 0}, 1),
    ],
    ids=["required", "required-parallel", "named"],
)
async def test_forced_calls_stream_helper_emits_every_done_event(client, tool_choice, extra, num_calls):
    done, final, plain = await streamed_and_plain(client, tool_choice=tool_choice, max_tokens=MAX_TOKENS, **extra)
    assert plain.finish_reason == final.finish_reason == "tool_calls"
    assert len(plain.message.tool_calls) == num_calls
    assert [(name, arguments) for _, name, arguments in done] == calls_of(plain) == calls_of(final)
    assert [index for index, _, _ in done] == list(range(num_calls))
    assert final.message.content is None and plain.message.content is None
    for name, arguments in calls_of(plain):
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize(("script", "content", "num_calls"), [(ONE_CALL, "Let me look.", 1), (TWO_CALLS, "Done.", 2)],
                         ids=["one", "two"])  # fmt: skip
async def test_auto_calls_stream_helper_emits_every_done_event(hermes_client, script, content, num_calls):
    request = {"tool_choice": "auto", "max_tokens": MAX_TOKENS, "extra_body": {"structured_outputs": {"choice": [script]}}}
    done, final, plain = await streamed_and_plain(hermes_client, **request)
    assert plain.finish_reason == final.finish_reason == "tool_calls"
    assert plain.message.content == final.message.content == content  # text before and after the calls, both ways
    assert len(done) == num_calls
    assert [(name, arguments) for _, name, arguments in done] == calls_of(plain) == calls_of(final)


async def test_chunks_have_openai_shape(http, hermes_http):
    """The role alone first; each call's first delta has its id, type and name with
    arguments "", the next ones only arguments; finish_reason alone in the last chunk."""
    requests = [
        (http, {"tool_choice": "required", "temperature": 1.0, "seed": 3}),
        (http, {"tool_choice": NAMED, "temperature": 0}),
        (hermes_http, {"tool_choice": "auto", "structured_outputs": {"choice": [TWO_CALLS]}}),
    ]
    for client, extra in requests:
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, "stream": True, **extra}
        choices = [e["choices"][0] for e in parse_sse(await client.post("/v1/chat/completions", json=body))]
        assert choices[0]["delta"] == {"role": "assistant"}  # no content: an answer of calls alone has null
        assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] == "tool_calls"
        assert all(c["finish_reason"] is None for c in choices[:-1])
        deltas = [call for c in choices for call in c["delta"].get("tool_calls", [])]
        assert all(len(c["delta"].get("tool_calls", [])) <= 1 for c in choices)
        seen = set()
        for call in deltas:
            if call["index"] not in seen:
                seen.add(call["index"])
                assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function", call
                assert call["function"]["arguments"] == "" and call["function"]["name"] in SCHEMAS
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}, call
        assert sorted(seen) == list(range(len(seen))) and seen
        for index in seen:  # the arguments follow the call's first chunk, in pieces as they are generated
            assert len([d for d in deltas if d["index"] == index and "id" not in d]) > 1


async def test_parsers_check_the_declared_tools(engine_client, engine, hermes_http):
    """Not a call (the text stays content, streamed and not): an undeclared function, a
    plain JSON answer under llama3_json, a strict tool's or a no-parameters tool's
    arguments that do not meet its schema."""
    ping = {"type": "function", "function": {"name": "ping"}}
    strict = {"type": "function", "function": {"name": "get_time", "parameters": {**SCHEMAS["get_weather"]},
                                               "strict": True}}  # fmt: skip
    llama = asgi_client(create_openai_app(engine_client, engine.tokenizer, MODEL, tool_call_parser="llama3_json"))
    cases = [
        (hermes_http, TOOLS, '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>'),
        (hermes_http, [ping], '<tool_call>{"name": "ping", "arguments": {"x": 1}}</tool_call>'),
        (hermes_http, [strict], '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'),
        (llama, TOOLS, '{"name": "Alice", "age": 30}'),
        (llama, [{"type": "function", "function": {"name": "Alice"}}], '{"name": "Alice", "age": 30}'),
    ]
    for client, tools, script in cases:
        body = {"model": MODEL, "messages": MESSAGES, "tools": tools, "max_tokens": MAX_TOKENS,
                "structured_outputs": {"choice": [script]}}  # fmt: skip
        choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": script} and choice["finish_reason"] == "stop"
        events = parse_sse(await client.post("/v1/chat/completions", json={**body, "stream": True}))
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == script
        assert not any("tool_calls" in e["choices"][0]["delta"] for e in events)
    # the same strict tool's call that meets its schema is one
    script = '<tool_call>{"name": "get_time", "arguments": {"city": "Rome", "unit": "c"}}</tool_call>'
    body = {"model": MODEL, "messages": MESSAGES, "tools": [strict], "max_tokens": MAX_TOKENS,
            "structured_outputs": {"choice": [script]}}  # fmt: skip
    choice = (await hermes_http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome", "unit": "c"}'
    await llama.aclose()


async def test_lone_surrogate_escapes_in_model_output_are_no_500(hermes_http):
    """Model text whose escapes decode to a lone surrogate: in the arguments the escape is
    kept (valid JSON, encodable); in the name it names no declared tool, so it is text."""
    in_arguments = r'<tool_call>{"name": "get_time", "arguments": {"zone": "\ud800"}}</tool_call>'
    in_name = r'<tool_call>{"name": "get_time\udfff", "arguments": {}}</tool_call>'
    for script, arguments in ((in_arguments, r'{"zone": "\ud800"}'), (in_name, None)):
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS,
                "structured_outputs": {"choice": [script]}}  # fmt: skip
        response = await hermes_http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        if arguments is None:
            assert message == {"role": "assistant", "content": script}
        else:
            assert message["tool_calls"][0]["function"]["arguments"] == arguments
            assert message["content"] is None
        events = parse_sse(await hermes_http.post("/v1/chat/completions", json={**body, "stream": True}))
        assert not any("error" in e for e in events)


async def test_auto_without_a_parser_is_a_400_as_in_vllm(http):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}
    for extra in ({"tool_choice": "auto"}, {}, {"tool_choice": "auto", "stream": True}):
        assert_openai_error(await http.post("/v1/chat/completions", json={**body, **extra}), 400, "tool_choice",
                            "tool_call_parser")  # fmt: skip
    # 'none' and forced choices need no parser
    assert (await http.post("/v1/chat/completions", json={**body, "tool_choice": "none"})).status_code == 200


async def test_strict_and_parameterless_tools(http, hermes_http):
    """A tool without parameters takes none (a forced call's arguments are {}); strict is
    honoured (forced: the constraint; auto: the call is checked) or refused: under auto a
    strict schema with a pattern cannot be checked in bounded time."""
    ping = [{"type": "function", "function": {"name": "ping"}}]
    body = {"model": MODEL, "messages": MESSAGES, "tools": ping, "max_tokens": 20, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "ping"}}}  # fmt: skip
    (call,) = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "ping", "arguments": "{}"}
    patterned = {"type": "function", "function": {"name": "get_time", "parameters": SCHEMAS["get_time"],
                                                  "strict": True}}  # fmt: skip
    body = {"model": MODEL, "messages": MESSAGES, "tools": [patterned], "max_tokens": 4}
    assert_openai_error(await hermes_http.post("/v1/chat/completions", json=body), 400, "tools[0].function.strict",
                        "pattern")  # fmt: skip
    forced = await hermes_http.post("/v1/chat/completions", json={**body, "tool_choice": "required", "max_tokens": 60})
    assert forced.status_code == 200, forced.text
    bad = {**patterned, "function": {**patterned["function"], "strict": "yes"}}
    assert_openai_error(await http.post("/v1/chat/completions", json={**body, "tools": [bad], "tool_choice": "required"}),
                        400, "tools[0].function.strict")  # fmt: skip


async def test_mistral_and_pythonic_parsers_over_http(engine_client, engine):
    for parser, script in (
        ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'),
        ("pythonic", '[get_time(zone="UTC")]'),
    ):
        app = create_openai_app(engine_client, engine.tokenizer, MODEL, tool_call_parser=parser)
        async with openai_client(app) as client:
            request = {"tool_choice": "auto", "max_tokens": MAX_TOKENS, "extra_body": {"structured_outputs": {"choice": [script]}}}
            done, final, plain = await streamed_and_plain(client, **request)
        assert calls_of(plain) == calls_of(final) == [("get_time", '{"zone": "UTC"}')]
        assert [(n, a) for _, n, a in done] == calls_of(plain)
        assert plain.message.content == final.message.content == ("Sure." if parser == "mistral" else None)
        if parser == "mistral":  # Mistral's templates take 9-character call ids
            assert len(plain.message.tool_calls[0].id) == 9 and plain.message.tool_calls[0].id.isalnum()
