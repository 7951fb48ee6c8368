"""Streamed events are formatted once per stream (id, object, created, model) and joined
per event: byte for byte what pydantic writes for the whole chunk model. Events ready
together leave in one body message: the chat role with the first token, the last event
with the usage event and [DONE], which ends the response."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from rayserve_paged.deployments.protocol import UsageInfo
from rayserve_paged.deployments.serving.chat import ChatChunkChoice, ChatCompletionChunk, DeltaMessage, chat_choice_json
from rayserve_paged.deployments.serving.completions import (
    CompletionChoice,
    CompletionStreamResponse,
    completion_choice_json,
)
from rayserve_paged.deployments.sse import EventFrame, sse_event
from tests.deployments.conftest import MODEL

TEXTS = ["", " plain", 'quote " and \\ slash /', "line\nbreak\ttab\r\b\f", "\x00\x01\x1f\x7f", "é 日本語 😀 👩‍👩‍👧",
         "\u2028\u2029 sep", "<|im_end|>"]  # fmt: skip
REASONS = [(None, None), ("stop", "\n\n"), ("stop", 2), ("length", None), ("abort", None), ("stop", 'a"b')]
IDS = [("cmpl-0123abcd", "tiny-opt"), ('odd"id\\', "модель/日本")]


def test_completion_events_equal_pydantics():
    for (response_id, model), text, (finish, stop), index in itertools.product(IDS, TEXTS, REASONS, (0, 3)):
        frame = EventFrame(response_id, "text_completion", 1767225600, model)
        other = CompletionChoice(index=index + 1, text=text[::-1], finish_reason=None, stop_reason=None)
        choices = [CompletionChoice(index=index, text=text, finish_reason=finish, stop_reason=stop), other]
        body = CompletionStreamResponse(id=response_id, created=1767225600, model=model, choices=choices)
        fast = [completion_choice_json(c.index, c.text, c.finish_reason, c.stop_reason) for c in choices]
        assert frame.event(fast) == sse_event(body)
        assert frame.event(fast[:1]).encode() == sse_event(body.model_copy(update={"choices": choices[:1]})).encode()


def test_chat_events_equal_pydantics():
    for (response_id, model), text, (finish, stop) in itertools.product(IDS, TEXTS, REASONS):
        frame = EventFrame(response_id, "chat.completion.chunk", 1767225600, model)
        delta = DeltaMessage(content=text) if text else DeltaMessage()
        choice = ChatChunkChoice(index=1, delta=delta, finish_reason=finish, stop_reason=stop)
        body = ChatCompletionChunk(id=response_id, created=1767225600, model=model, choices=[choice])
        assert frame.event([chat_choice_json(1, text, finish, stop)]) == sse_event(body)


def test_usage_and_model_built_choices_join_the_frame():
    frame = EventFrame("chat-1", "chat.completion.chunk", 5, "m")
    usage = UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    body = ChatCompletionChunk(id="chat-1", created=5, model="m", choices=[], usage=usage)
    assert frame.event([], usage) == sse_event(body)
    role = ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
    body = ChatCompletionChunk(id="chat-1", created=5, model="m", choices=[role])
    assert frame.event([role.model_dump_json()]) == sse_event(body)


async def _asgi_messages(app, path: str, body: dict) -> list[dict]:
    """What the app sends for one POST, as ASGI messages (a client that never leaves)."""
    request = {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
    requests = [request]

    async def receive():
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # no disconnect: the response ends by itself

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"test"), (b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("test", 80)}  # fmt: skip
    await app(scope, receive, send)
    return sent


def _bodies(messages: list[dict]) -> list[list[str]]:
    """The events of each body message; every message but the last says more_body."""
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    bodies = messages[1:]
    assert all(m["type"] == "http.response.body" for m in bodies)
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    return [[e for e in m["body"].decode().split("\n\n") if e] for m in bodies]


@pytest.mark.anyio
async def test_the_last_event_usage_and_done_end_the_response_in_one_message(app):
    body = {"model": MODEL, "prompt": "Paged attention", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    bodies = _bodies(await _asgi_messages(app, "/v1/completions", body))
    assert all(len(events) == 1 for events in bodies[:-1])  # one event per engine step until the end
    *last, usage, done = bodies[-1]
    assert len(last) == 1 and json.loads(last[0].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert json.loads(usage.removeprefix("data: "))["usage"]["completion_tokens"] == 6
    assert done == "data: [DONE]"


@pytest.mark.anyio
async def test_the_chat_role_leaves_with_the_first_token(app):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 1,
            "seed": 0, "ignore_eos": True, "stream": True, "n": 2}  # fmt: skip
    bodies = _bodies(await _asgi_messages(app, "/v1/chat/completions", body))
    first = [json.loads(e.removeprefix("data: "))["choices"] for e in bodies[0]]
    assert [c["delta"] for choices in first[:2] for c in choices] == [{"role": "assistant", "content": ""}] * 2
    assert len(first) == 3 and {c["index"] for c in first[2]} == {0, 1}
    assert all("role" not in c["delta"] for c in first[2])  # the first token's event
    assert bodies[-1][-1] == "data: [DONE]"
    events = [json.loads(e.removeprefix("data: ")) for events in bodies for e in events[:-1] if e != "data: [DONE]"]
    assert sum(c["finish_reason"] == "length" for e in events for c in e["choices"]) == 2
