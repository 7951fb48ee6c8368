"""Response bodies: JSON, and server-sent events (one `data:` event per chunk, `[DONE]` last).

A stream's events share everything but their choices and usage, so `EventFrame` formats
that part once per stream and each event joins its choices' JSON into it: the bytes are
those pydantic writes for the whole chunk model (compact, UTF-8 unescaped), without a
model per token. `json_value` writes a str, int or None as pydantic does (floats differ:
pydantic writes 1e-5 where Python writes 1e-05, so choices with logprobs stay models).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

SSE_DONE = "data: [DONE]\n\n"
_SSE_DONE_BYTES = SSE_DONE.encode()


def json_response(body: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    # pydantic's JSON writes a non-finite logprob as null where json.dumps would fail
    return Response(body.model_dump_json(), status_code=status_code, headers=headers, media_type="application/json")


def sse_event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


_json_string = json.encoder.encode_basestring  # C: a str as JSON, UTF-8 left as is (ensure_ascii=False)


def json_value(value: str | int | None) -> str:
    if value is None:
        return "null"
    if type(value) is str:
        return _json_string(value)
    return json.dumps(value, ensure_ascii=False)


class EventFrame:
    """One stream's events: `data: {"id":…,"object":…,"created":…,"model":…,` formatted
    once, then per event its choices (each already JSON) and usage (null, or once a model)."""

    __slots__ = ("_head",)

    def __init__(self, response_id: str, object_name: str, created: int, model: str) -> None:
        head = f'{{"id":{json_value(response_id)},"object":{json_value(object_name)},"created":{int(created)}'
        self._head = f'data: {head},"model":{json_value(model)},"choices":['

    def event(self, choices: list[str], usage: BaseModel | None = None) -> str:
        usage_json = "null" if usage is None else usage.model_dump_json()
        return f'{self._head}{",".join(choices)}],"usage":{usage_json}}}\n\n'


class EventStreamResponse(StreamingResponse):
    """Server-sent events that always close their generator, however the response ends.

    Starlette leaves the body iterator suspended when a send fails or the task is
    cancelled between chunks, and never starts it when the client leaves first; closing
    the events and then the engine outputs they read runs the `finally` that aborts.
    The chunk that ends with [DONE] ends the response (`more_body` false): no empty body
    message after it for Serve's proxy to relay.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], outputs: AsyncIterator) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._outputs = outputs

    @property
    def outputs(self) -> AsyncIterator:
        """The engine outputs the events read (a route that rewrites the events closes them too)."""
        return self._outputs

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            body = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
            is_last = body.endswith(_SSE_DONE_BYTES)  # an event's JSON never ends so
            await send({"type": "http.response.body", "body": body, "more_body": not is_last})
            if is_last:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._outputs.aclose()
