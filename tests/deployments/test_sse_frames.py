"""Streamed events are formatted once per stream (id, object, created, model) and joined
per event: byte for byte what pydantic writes for the whole chunk model."""

from __future__ import annotations

import itertools

from rayserve_paged.deployments.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
)
from rayserve_paged.deployments.serving.chat import chat_choice_json
from rayserve_paged.deployments.serving.completions import completion_choice_json
from rayserve_paged.deployments.sse import EventFrame, sse_event

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
