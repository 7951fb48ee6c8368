"""A client that goes away aborts its engine requests: nothing keeps running, every KV
block is free again (the engine_client fixture checks both after each test).

The ASGI app is driven directly: httpx's ASGITransport reads a whole response before
returning, so it cannot leave in the middle of a stream.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.deployments.conftest import MODEL

pytestmark = pytest.mark.anyio

LONG = {"model": MODEL, "prompt": "Hello world", "max_tokens": 100, "ignore_eos": True, "temperature": 0}


def _scope(body: bytes, spec_version: str = "2.3") -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 5000),
        "server": ("test", 80),
    }


class _Connection:
    """receive/send for one request; `left` is set once the client has gone."""

    def __init__(self, body: bytes, leave_after_chunks: int, how: str) -> None:
        self.body = body
        self.leave_after_chunks = leave_after_chunks
        self.how = how
        self.chunks: list[bytes] = []
        self.left = asyncio.Event()
        self._sent_body = False

    async def receive(self) -> dict:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.left.is_set() and self.how == "send fails":
            raise OSError("connection reset")  # what a server does on ASGI spec >= 2.4
        if message["type"] == "http.response.body" and message.get("body"):
            self.chunks.append(message["body"])
            if len(self.chunks) >= self.leave_after_chunks:
                self.left.set()


async def _wait_idle(engine, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while engine.has_unfinished_requests():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("how", ["disconnect message", "send fails", "task cancelled"])
async def test_leaving_mid_stream_aborts_the_request(app, http, engine, engine_client, how):
    body = json.dumps({**LONG, "stream": True}).encode()
    connection = _Connection(body, leave_after_chunks=3, how=how)
    scope = _scope(body, spec_version="2.4" if how == "send fails" else "2.3")
    task = asyncio.ensure_future(app(scope, connection.receive, connection.send))
    await asyncio.wait_for(connection.left.wait(), 30)
    if how == "task cancelled":  # what Ray Serve does to the replica's task when the client leaves
        task.cancel()
    try:
        await asyncio.wait_for(task, 30)
    except (asyncio.CancelledError, OSError, Exception):
        pass
    await _wait_idle(engine)
    assert len(engine_client.aborted) == 1 and engine_client.aborted[0].startswith("cmpl-")
    assert b"[DONE]" not in b"".join(connection.chunks)
    # the server goes on serving
    response = await http.post("/v1/completions", json={**LONG, "max_tokens": 2})
    assert response.status_code == 200


async def test_cancelled_non_stream_request_aborts_all_its_prompts(app, engine, engine_client):
    body = json.dumps({**LONG, "prompt": ["Hello world", "Another one"]}).encode()
    connection = _Connection(body, leave_after_chunks=1, how="task cancelled")
    task = asyncio.ensure_future(app(_scope(body), connection.receive, connection.send))
    async with asyncio.timeout(30):
        while engine.num_unfinished_requests() < 2:
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _wait_idle(engine)
    assert sorted(engine_client.aborted) == sorted(set(engine_client.aborted)) and len(engine_client.aborted) == 2
