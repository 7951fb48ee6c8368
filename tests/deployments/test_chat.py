"""/v1/chat/completions, /v1/models, /health and the official openai client."""

from __future__ import annotations

import copy

import httpx
import openai
import pytest

from rayserve_paged.deployments.openai_ingress import create_openai_app
from tests.deployments.conftest import MAX_MODEL_LEN, MODEL, assert_openai_error, parse_sse

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


async def test_chat_completion_applies_the_template_once(http, engine):
    response = await http.post("/v1/chat/completions", json={**GREEDY, "messages": MESSAGES, "max_tokens": 6})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    ids = chat_prompt_ids(engine.tokenizer, MESSAGES)
    assert ids.count(engine.tokenizer.bos_token_id) == 1  # the template's BOS, no second one
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 6,
        "total_tokens": len(ids) + 6,
        "prompt_tokens_details": None,  # cached_tokens are reported only when enabled
    }
    # the same tokens through /v1/completions give the same text
    completion = await http.post("/v1/completions", json={**GREEDY, "prompt": ids, "max_tokens": 6})
    assert completion.json()["choices"][0]["text"] == choice["message"]["content"]


async def test_max_completion_tokens_and_text_parts(http):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    body = {**GREEDY, "messages": parts, "max_completion_tokens": 3}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


async def test_chat_logprobs(http):
    body = {**GREEDY, "messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    choice = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        top = [t["logprob"] for t in entry["top_logprobs"]]
        assert top == sorted(top, reverse=True)
        assert entry["logprob"] == entry["top_logprobs"][0]["logprob"]  # greedy takes the best
        assert isinstance(entry["bytes"], list)


async def test_chat_stream_role_first_then_content(http):
    body = {**GREEDY, "messages": MESSAGES, "max_tokens": 8}
    expected = (await http.post("/v1/chat/completions", json=body)).json()
    response = await http.post(
        "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    *chunks, usage = parse_sse(response)
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == expected["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    assert usage["choices"] == [] and usage["usage"] == expected["usage"]
    # logprobs stream along, one entry per token
    response = await http.post("/v1/chat/completions", json={**body, "stream": True, "logprobs": True})
    choices = [c["choices"][0] for c in parse_sse(response)]
    entries = [entry for choice in choices if choice["logprobs"] for entry in choice["logprobs"]["content"]]
    assert len(entries) == expected["usage"]["completion_tokens"]


async def test_model_without_chat_template_is_a_400(engine_client, engine):
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = None
    app = create_openai_app(engine_client, tokenizer, MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        assert_openai_error(response, 400, "messages", "no chat template")
        assert (await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})).status_code == 200


async def test_models_and_health(http, engine_client):
    models = (await http.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [(MODEL, "model", MAX_MODEL_LEN)]
    assert (await http.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
    assert_openai_error(await http.get("/v1/models/other"), 404, "model")
    assert (await http.get("/health")).status_code == 200
    engine_client.is_healthy = False
    assert_openai_error(await http.get("/health"), 503)
    engine_client.is_healthy = True
    assert (await http.get("/health")).status_code == 200


async def test_official_openai_client(app):
    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=transport) as client:
        assert [m.id async for m in client.models.list()] == [MODEL]
        completion = await client.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        assert completion.usage.completion_tokens == 5
        stream = await client.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, stream=True
        )
        assert "".join([chunk.choices[0].text async for chunk in stream]) == completion.choices[0].text
        chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
        assert chat.choices[0].message.role == "assistant"
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, stream=True
        )
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream]
        assert "".join(pieces) == chat.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as raised:
            await client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
        assert raised.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="gpt-4", prompt="Hi")
        assert missing.value.body["code"] == "model_not_found"
