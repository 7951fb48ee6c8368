"""Requests that once reached a 500, each answered with its documented 4xx now, and the
server serving the next request: logit_bias keys that str.isdigit() accepts and int()
cannot parse, lone surrogates in the chat fields a template renders (name, tool_call_id,
tool_calls, tools), and a text the tokenizer cannot encode."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from tests.deployments.conftest import MODEL, assert_openai_error, parse_sse

pytestmark = pytest.mark.anyio

OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# a Llama-3-style template: renders the tools, names, tool calls and call ids it is given
TOOL_TEMPLATE = (
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}>"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ m.content }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SURROGATE = "\ud800"  # json.dumps writes it as the escape "\\ud800", as a hostile client can


async def _post(http: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    content = json.dumps(body).encode()  # ASCII: a lone surrogate travels as a JSON escape
    return await http.post(path, content=content, headers={"content-type": "application/json"})


async def _still_serving(http: httpx.AsyncClient) -> None:
    assert (await http.post("/v1/completions", json=OK)).json()["usage"]["completion_tokens"] == 2
    assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200


@pytest.mark.parametrize("key", ["²", "³", "--5", "٣", "+5", " 5", "5 ", "1_0", "", "12345678901", "0x10"])
@pytest.mark.parametrize("route, body", [("/v1/completions", OK), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
async def test_logit_bias_keys_must_be_ascii_integers(http, key, route, body, stream):
    response = await _post(http, route, {**body, "stream": stream, "logit_bias": {"5": 1.0, key: 2.0}})
    assert_openai_error(response, 400, "logit_bias", "token ids written in ASCII digits")
    await _still_serving(http)


async def test_logit_bias_ascii_keys_still_work(http, engine):
    eos = engine.tokenizer.eos_token_id
    body = {**OK, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"7": 100, f"{eos}": -100}}
    response = await http.post("/v1/completions", json={**body, "logprobs": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"]["tokens"] == [engine.tokenizer.decode([7])] * 3
    # a negative key parses, and the engine names it as outside the vocabulary
    response = await http.post("/v1/completions", json={**OK, "logit_bias": {"-1": 1.0}})
    assert_openai_error(response, 400, "logit_bias")


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
SURROGATE_CHATS = [
    ("name", {"messages": [{"role": "user", "content": "Hi", "name": SURROGATE}]}, "messages[0].name"),
    (
        "tool_call_id",
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "1", "tool_call_id": SURROGATE}]},
        "messages[1].tool_call_id",
    ),
    (
        "tool_calls value",
        {"messages": [{"role": "assistant", "tool_calls": [{**TOOL_CALL, "id": "x" + SURROGATE}]}]},
        "messages[0].tool_calls",
    ),
    (
        "tool_calls key",
        {"messages": [{"role": "assistant", "tool_calls": [{**TOOL_CALL, SURROGATE: 1}]}]},
        "messages[0].tool_calls",
    ),
    (
        "tools",
        {"messages": [{"role": "user", "content": "Hi"}],
         "tools": [{**TOOL, "function": {**TOOL["function"], "description": SURROGATE}}]},
        "tools",
    ),  # fmt: skip
    ("tool_choice", {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"x": SURROGATE}}, "tool_choice"),
]


@pytest.fixture
def tool_template(app, monkeypatch):
    monkeypatch.setattr(app.state.serving.tokenizer, "chat_template", TOOL_TEMPLATE)


# /tokenize renders messages too (it takes no tools)
SURROGATE_CASES = [("/v1/chat/completions", *case) for case in SURROGATE_CHATS] + [
    ("/tokenize", name, {"messages": body["messages"]}, param)
    for name, body, param in SURROGATE_CHATS
    if param.startswith("messages")
]


@pytest.mark.parametrize("route, name, body, param", SURROGATE_CASES, ids=[f"{c[0]} {c[1]}" for c in SURROGATE_CASES])
async def test_lone_surrogates_in_rendered_chat_fields_are_a_400(http, tool_template, route, name, body, param):
    if route != "/tokenize":
        body = {**CHAT, **body, "stream": name == "name"}
    response = await _post(http, route, body)
    assert_openai_error(response, 400, param, "lone surrogate U+D800")
    await _still_serving(http)


async def test_the_tool_template_renders_those_fields(http, tool_template, engine):
    """The same requests with valid text render all of them: the template does read them."""
    messages = [
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "1", "tool_call_id": "call_1"},
    ]
    response = await http.post("/tokenize", json={"messages": messages})
    text = engine.tokenizer.decode(response.json()["tokens"])
    assert "<user ann>Hi" in text and '"id": "call_1"' in text and "<tool>[call_1]1" in text
    plain = (await http.post("/v1/chat/completions", json=CHAT)).json()["usage"]["prompt_tokens"]
    tools = [{"type": "function", "function": {"name": "f"}}]
    named = {"type": "function", "function": {"name": "f"}}  # "auto" needs a tool_call_parser
    response = await http.post("/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": named})
    assert response.json()["usage"]["prompt_tokens"] > plain  # the tools were rendered


async def test_a_text_the_tokenizer_cannot_encode_is_a_400_naming_the_field(http, app, monkeypatch):
    """The last guard: tokenization runs inside the error mapping, whatever slips past validation."""
    tokenizer = app.state.serving.tokenizer
    call = type(tokenizer).__call__

    def refusing(self, text, *args, **kwargs):
        if "REFUSE" in text:
            raise UnicodeEncodeError("utf-8", text, 0, 1, "refused")
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", refusing)
    for route, body, param in (
        ("/v1/completions", {**OK, "prompt": "REFUSE"}, "prompt"),
        ("/v1/completions", {**OK, "prompt": ["ok", "REFUSE"], "stream": True}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "REFUSE"}]}, "messages"),
        ("/tokenize", {"prompt": "REFUSE"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "REFUSE"}]}, "messages"),
    ):
        assert_openai_error(await http.post(route, json=body), 400, param, "cannot be tokenized")
    await _still_serving(http)
    stream = await http.post("/v1/completions", json={**OK, "stream": True, "ignore_eos": True})
    assert parse_sse(stream)[-1]["choices"][0]["finish_reason"] == "length"


async def test_unknown_field_names_are_logged_escaped_cut_and_few(http, caplog):
    """A field name is the client's text: a newline in it cannot forge a log line, a long one
    cannot make a long line, many cannot make many (one WARNING per request, bounded)."""
    from rayserve_paged.deployments.serving.pipeline import MAX_LOGGED_FIELD_CHARS, MAX_LOGGED_FIELDS

    forged = "x\n2026-01-01 INFO rayserve_paged: admin logged in"
    huge = "y" * 100_000
    many = {f"f{i:03d}": 1 for i in range(50)}
    caplog.set_level(logging.WARNING, logger="rayserve_paged.deployments.serving")
    body = {**OK, forged: 1, huge: 2, "\x1b[31m\u00e9": 3, **many}
    response = await _post(http, "/v1/completions", body)
    assert response.status_code == 200, response.text
    (record,) = [r for r in caplog.records if "unknown request fields" in r.getMessage()]
    line = record.getMessage()
    assert "\n" not in line and "\x1b" not in line and line.isascii()
    assert line.startswith("ignored 53 unknown request fields: ") and line.endswith(f"(and {53 - MAX_LOGGED_FIELDS} more)")
    names = line.removeprefix("ignored 53 unknown request fields: ").rsplit(" (and", 1)[0].split(", ")
    assert len(names) == MAX_LOGGED_FIELDS and all(len(n) <= MAX_LOGGED_FIELD_CHARS for n in names)
    # sorted: the escaped control sequence first, then f000 ...
    assert names[0] == "\\x1b[31m\\xe9" and names[1] == "f000"
    assert len(line) < 40 + MAX_LOGGED_FIELDS * (MAX_LOGGED_FIELD_CHARS + 2) + 20
    # the names themselves: an escaped newline, a cut name
    small = {**OK, forged: 1, huge: 2}
    caplog.clear()
    assert (await _post(http, "/v1/completions", small)).status_code == 200
    (record,) = [r for r in caplog.records if "unknown request fields" in r.getMessage()]
    assert record.getMessage() == (
        "ignored 2 unknown request fields: x\\n2026-01-01 INFO rayserve_paged: admin logged in, "
        + "y" * (MAX_LOGGED_FIELD_CHARS - 3) + "..."
    )
