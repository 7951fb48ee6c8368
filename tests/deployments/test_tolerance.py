"""What agent and tool-using clients send is served (vLLM's tolerance): unknown fields are
ignored and logged, null means unset, tool messages and tools reach the chat template;
logit_bias and min_tokens work; /tokenize and /detokenize."""

from __future__ import annotations

import logging

import pytest

from tests.deployments.conftest import MODEL

pytestmark = pytest.mark.anyio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather?"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
AGENT_TURNS = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "What is the weather?", "name": "alice"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]

CLIENT_PAYLOADS = [
    ("/v1/chat/completions", {**CHAT, "logit_bias": None}),
    ("/v1/chat/completions", {**CHAT, "tools": []}),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "auto"}),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "none", "parallel_tool_calls": True}),
    ("/v1/chat/completions", {**CHAT, "messages": AGENT_TURNS}),
    ("/v1/chat/completions", {**CHAT, "some_new_openai_field": {"x": 1}, "metadata": {"k": "v"}}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}, "max_tokens": None,
                              "max_completion_tokens": 3}),  # fmt: skip
    ("/v1/chat/completions", {**CHAT, "n": None, "temperature": None, "stop": None, "seed": None, "top_p": None,
                              "stream_options": None, "user": None, "logprobs": None, "top_logprobs": None}),  # fmt: skip
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True, "extra": 1}}),
    ("/v1/completions", {**COMPLETION, "logit_bias": None, "suffix": None, "unknown": 5}),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"50": 2.5}, "min_tokens": 2}),
]


@pytest.mark.parametrize("route, body", CLIENT_PAYLOADS)
async def test_client_payloads_are_served(hermes_http, route, body):
    # a deployment with a tool_call_parser: without one, tool_choice "auto" is a 400 (as vLLM's)
    response = await hermes_http.post(route, json=body)
    assert response.status_code == 200, response.text


async def test_unknown_fields_are_logged(http, caplog):
    with caplog.at_level(logging.WARNING, logger="rayserve_paged.deployments.openai_ingress"):
        body = {**CHAT, "frobnicate": 1, "messages": [{"role": "user", "content": "Hi", "mood": "good"}]}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    assert "frobnicate" in caplog.text and "messages[0].mood" in caplog.text


async def test_tool_messages_and_tools_reach_the_chat_template(hermes_app, engine, monkeypatch):
    app = hermes_app
    seen = {}
    original = engine.tokenizer.apply_chat_template

    def recording(messages, **options):
        seen.update(messages=messages, tools=options.get("tools"))
        return original(messages, **options)

    monkeypatch.setattr(app.state.serving.tokenizer, "apply_chat_template", recording)
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        body = {**CHAT, "messages": AGENT_TURNS, "tools": [TOOL]}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    assert seen["tools"] == [TOOL]
    assert seen["messages"][1]["name"] == "alice"
    assert seen["messages"][2] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert seen["messages"][3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


async def test_logit_bias_steers_the_sampler(http):
    body = {**COMPLETION, "max_tokens": 5, "temperature": 0, "logit_bias": {"77": 100}, "logprobs": 0}
    choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
    plain = (await http.post("/v1/completions", json={**body, "logit_bias": None})).json()["choices"][0]
    assert len(set(choice["logprobs"]["tokens"])) == 1  # token 77, every time
    assert choice["logprobs"]["tokens"] != plain["logprobs"]["tokens"]


async def test_min_tokens_holds_back_stop_tokens(http, engine):
    first = (await http.post("/v1/completions", json={**COMPLETION, "temperature": 0, "max_tokens": 1,
                                                       "logprobs": 0})).json()  # fmt: skip
    first_id = engine.tokenizer.convert_tokens_to_ids(engine.tokenizer.tokenize(first["choices"][0]["text"]))[0]
    body = {**COMPLETION, "temperature": 0, "max_tokens": 8, "stop_token_ids": [first_id], "ignore_eos": True}
    stopped = (await http.post("/v1/completions", json=body)).json()
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["stop_reason"] == first_id
    held = (await http.post("/v1/completions", json={**body, "min_tokens": 4})).json()
    assert held["usage"]["completion_tokens"] >= 4


async def test_tokenize_and_detokenize(http, engine):
    response = await http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == engine.tokenizer("Hello world").input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == engine.max_model_len
    chat = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                add_generation_prompt=True)  # fmt: skip
    assert chat["tokens"] == engine.tokenizer(text, add_special_tokens=False).input_ids
    back = await http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and "Hello world" in back.json()["prompt"]
    bad = await http.post("/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = await http.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "y"}]})
    assert both.status_code == 400
