"""Response bodies: JSON, and server-sent events (one `data:` event per chunk, `[DONE]` last)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

SSE_DONE = "data: [DONE]\n\n"


def json_response(body: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    # pydantic's JSON writes a non-finite logprob as null where json.dumps would fail
    return Response(body.model_dump_json(), status_code=status_code, headers=headers, media_type="application/json")


def sse_event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events that always close their generator, however the response ends.

    Starlette leaves the body iterator suspended when a send fails or the task is
    cancelled between chunks, and never starts it when the client leaves first; closing
    the events and then the engine outputs they read runs the `finally` that aborts.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], outputs: AsyncIterator) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._outputs = outputs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._outputs.aclose()
