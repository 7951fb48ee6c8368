"""Streams are deltas joined by the client: the joined stream equals the non-streamed answer
(n > 1, logprobs, stop strings, include_usage), prefix-cache hits show in usage, and a
reader that stops reading does not hold up anyone else."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.deployments.openai_ingress import create_openai_app
from tests.deployments.conftest import MODEL, parse_sse

pytestmark = pytest.mark.anyio

PROMPT = "Paged attention keeps the cache in blocks"
MESSAGES = [{"role": "user", "content": "Hello there"}]
SEEDED = {"model": MODEL, "temperature": 1.0, "seed": 7, "ignore_eos": True, "max_tokens": 24}


async def _post(http, path: str, body: dict) -> dict:
    response = await http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def _a_stop_string(http) -> str:
    """Two characters from the middle of what the seeded request writes: a stop string it
    is sure to meet."""
    text = (await _post(http, "/v1/completions", {**SEEDED, "prompt": PROMPT}))["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2
    return stop


def _joined(events: list[dict], key) -> dict[int, dict]:
    """Per choice index: the joined text, finish and stop reasons, and logprob tokens."""
    joined: dict[int, dict] = {}
    for event in events:
        for choice in event["choices"]:
            item = joined.setdefault(choice["index"], {"text": "", "finish_reason": None, "stop_reason": None,
                                                       "tokens": []})  # fmt: skip
            item["text"] += key(choice)
            if choice.get("finish_reason") is not None:
                assert item["finish_reason"] is None  # said once
                item["finish_reason"], item["stop_reason"] = choice["finish_reason"], choice.get("stop_reason")
            logprobs = choice.get("logprobs")
            if logprobs:
                item["tokens"] += logprobs["tokens"] if "tokens" in logprobs else [t["token"] for t in logprobs["content"]]
    return joined


async def assert_streamed_completion_equals_the_whole_one(http) -> tuple[list[dict], dict]:
    """n > 1, logprobs, a stop string and include_usage; (the stream's chunks, the whole answer)."""
    stop = await _a_stop_string(http)
    body = {**SEEDED, "prompt": [PROMPT, "Hello world"], "n": 2, "logprobs": 2, "stop": [stop]}
    whole = await _post(http, "/v1/completions", body)
    response = await http.post(
        "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = parse_sse(response)
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    joined = _joined(chunks, lambda c: c["text"])
    assert sorted(joined) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        got = joined[choice["index"]]
        assert got["text"] == choice["text"]
        assert (got["finish_reason"], got["stop_reason"]) == (choice["finish_reason"], choice["stop_reason"])
        assert got["tokens"] == choice["logprobs"]["tokens"]
    assert any(c["stop_reason"] == stop and stop not in c["text"] for c in whole["choices"])
    # no event carries a choice index twice
    assert all(len({c["index"] for c in e["choices"]}) == len(e["choices"]) for e in chunks)
    return chunks, whole


async def test_streamed_completion_equals_the_whole_one(http):
    await assert_streamed_completion_equals_the_whole_one(http)


async def test_streamed_chat_equals_the_whole_one(http):
    stop = await _a_stop_string(http)
    body = {**SEEDED, "messages": MESSAGES, "n": 2, "logprobs": True, "top_logprobs": 1, "stop": stop}
    whole = await _post(http, "/v1/chat/completions", body)
    response = await http.post(
        "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    *chunks, usage = parse_sse(response)
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    joined = _joined(chunks, lambda c: c["delta"].get("content", ""))
    for choice in whole["choices"]:
        got = joined[choice["index"]]
        assert got["text"] == choice["message"]["content"]
        assert (got["finish_reason"], got["stop_reason"]) == (choice["finish_reason"], choice["stop_reason"])
        assert got["tokens"] == [t["token"] for t in choice["logprobs"]["content"]]


@pytest.fixture
async def http_with_details(engine_client, engine):
    app = create_openai_app(engine_client, engine.tokenizer, MODEL, enable_prompt_tokens_details=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client


async def test_a_repeated_long_prompt_reports_cached_tokens(http_with_details, engine):
    http = http_with_details
    prompt = " ".join(["blocks of sixteen tokens"] * 6)  # several full blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = await _post(http, "/v1/completions", body)
    second = await _post(http, "/v1/completions", body)
    num_prompt = first["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    block = engine.config.block_size
    assert num_prompt > 2 * block and cached == (num_prompt - 1) // block * block  # every full block but the last token's
    response = await http.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert parse_sse(response)[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


async def test_a_plain_httpx_sse_reader(app):
    body = {**SEEDED, "prompt": PROMPT, "stream": True}
    text, is_done = "", False
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    is_done = True
                    break
                text += "".join(c["text"] for c in json.loads(data)["choices"])
        whole = await client.post("/v1/completions", json={**body, "stream": False})
    assert is_done and text == whole.json()["choices"][0]["text"]


async def test_a_reader_that_stops_reading_does_not_stall_others(engine_client, engine):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = engine.tokenizer(PROMPT).input_ids
    slow = engine_client.generate_stream(ids, params, "slow")
    first = await anext(slow)  # the first token comes at once
    assert len(first.outputs[0].token_ids) == 1
    # the slow reader reads nothing more; another request runs to the end meanwhile
    other = await asyncio.wait_for(engine_client.generate(ids, params, "other"), 30)
    assert other.finished and len(other.outputs[0].token_ids) == 30
    rest = [out async for out in slow]
    # what it did not read was coalesced: far fewer items than steps, nothing lost
    assert len(rest) < 29
    assert first.outputs[0].token_ids + [t for out in rest for t in out.outputs[0].token_ids] == other.outputs[0].token_ids
    assert first.outputs[0].text + "".join(out.outputs[0].text for out in rest) == other.outputs[0].text


async def test_cached_tokens_are_not_reported_by_default(http):
    prompt = " ".join(["blocks of sixteen tokens"] * 6)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        assert (await _post(http, "/v1/completions", body))["usage"]["prompt_tokens_details"] is None
    response = await http.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert parse_sse(response)[-1]["usage"]["prompt_tokens_details"] is None


async def test_cache_salt_keeps_each_tenants_prefix_to_itself(http_with_details, engine):
    """Salted requests share cached blocks only with the same salt: another salt (or none)
    sees no hit, so neither cached_tokens nor the time to first token tells it anything."""
    http = http_with_details
    prompt = " ".join(["a secret system prompt of many blocks"] * 4)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    usage = (await _post(http, "/v1/completions", {**body, "cache_salt": "tenant-a"}))["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    block = engine.config.block_size
    full = (usage["prompt_tokens"] - 1) // block * block
    for salt, expected in (("tenant-b", 0), (None, 0), ("tenant-a", full)):
        salted = {**body, "cache_salt": salt} if salt else body
        got = (await _post(http, "/v1/completions", salted))["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert got == expected, salt
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "cache_salt": "c"}
    first = (await _post(http, "/v1/chat/completions", chat))["usage"]["prompt_tokens_details"]["cached_tokens"]
    again = (await _post(http, "/v1/chat/completions", chat))["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (first, again > 0) == (0, True)
    response = await http.post("/v1/completions", json={**body, "cache_salt": ""})
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"
