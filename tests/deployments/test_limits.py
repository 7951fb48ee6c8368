"""Request limits: an oversize body is a 413 before it is parsed; past the admission limit,
or when Serve's queue to LLMServer is full, a request is a prompt 503 with Retry-After,
never a timeout, and what was admitted completes."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from rayserve_paged.app import AppArgs, llm_server_options
from rayserve_paged.deployments.errors import RETRY_AFTER_S
from rayserve_paged.deployments.openai_ingress import (
    DEFAULT_MAX_PENDING_REQUESTS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    create_openai_app,
)
from tests.deployments.conftest import MAX_MODEL_LEN, MODEL, assert_openai_error, record_binds
from tests.deployments.test_disconnect import _Connection, _scope, _wait_idle

pytestmark = pytest.mark.anyio

OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test", headers={"content-type": "application/json"}
    )


def _padded(size: int) -> bytes:
    """A valid completion body of exactly `size` bytes (JSON allows trailing spaces)."""
    body = json.dumps(OK).encode()
    return body + b" " * (size - len(body))


async def _call(app, body_chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, int]:
    """Drive the ASGI app directly: (status, JSON body, number of body chunks it read)."""
    scope = {**_scope(b""), "headers": [(b"content-type", b"application/json"), *headers]}
    pending = [
        {"type": "http.request", "body": chunk, "more_body": i < len(body_chunks) - 1}
        for i, chunk in enumerate(body_chunks)
    ]
    num_read = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal num_read
        if num_read < len(pending):
            num_read += 1
            return pending[num_read - 1]
        await asyncio.sleep(3600)  # a client that waits for its answer

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 30)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), num_read


# --------------------------------------------------------------------------- body size


async def test_body_size_limit_checks_content_length_before_reading(engine_client, engine):
    app = create_openai_app(engine_client, engine.tokenizer, MODEL, max_request_body_bytes=1000)
    async with _http(app) as http:
        assert (await http.post("/v1/completions", content=_padded(1000))).status_code == 200
        # over the limit: 413, even for a body that is not JSON at all (never parsed)
        for body in (_padded(1001), b"{" * 5000):
            response = await http.post("/v1/completions", content=body)
            error = assert_openai_error(response, 413, None, "1000 bytes")
            assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
        assert (await http.post("/v1/completions", content=_padded(1000))).status_code == 200
    # the declared length alone decides: not one body chunk is read
    status, _, num_read = await _call(app, [b"{}"], [(b"content-length", b"5000")])
    assert (status, num_read) == (413, 0)


async def test_body_size_limit_counts_the_bytes_received(engine_client, engine):
    app = create_openai_app(engine_client, engine.tokenizer, MODEL, max_request_body_bytes=1000)
    chunks = [b" " * 200] * 20
    # chunked (no Content-Length): reading stops at the chunk that crosses the limit
    status, body, num_read = await _call(app, chunks, [])
    assert (status, body["error"]["code"], num_read) == (413, "request_too_large", 6)
    # a Content-Length that understates the body does not get it past the limit
    status, _, num_read = await _call(app, chunks, [(b"content-length", b"10")])
    assert (status, num_read) == (413, 6)
    # chunked and within the limit: served
    status, body, _ = await _call(app, [json.dumps(OK).encode()[:10], json.dumps(OK).encode()[10:]], [])
    assert status == 200 and body["object"] == "text_completion"
    status, body, _ = await _call(app, [b"{}"], [(b"content-length", b"two")])
    assert status == 400 and "Content-Length" in body["error"]["message"]


# --------------------------------------------------------------------------- admission


class _GatedClient:
    """An engine client whose requests wait for `gate`: they stay in flight on demand."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.num_active = 0
        self.peak_active = 0

    async def generate(self, prompt, sampling_params, request_id):
        self._enter()
        try:
            await self.gate.wait()
            return await self.inner.generate(prompt, sampling_params, request_id)
        finally:
            self.num_active -= 1

    async def generate_stream(self, prompt, sampling_params, request_id):
        self._enter()
        try:
            await self.gate.wait()
            async for output in self.inner.generate_stream(prompt, sampling_params, request_id):
                yield output
        finally:
            self.num_active -= 1

    def _enter(self) -> None:
        self.num_active += 1
        self.peak_active = max(self.peak_active, self.num_active)

    def __getattr__(self, name):  # abort, model_info, metrics_text
        return getattr(self.inner, name)


def _assert_overloaded(response: httpx.Response, retry_after: int = RETRY_AFTER_S) -> None:
    error = assert_openai_error(response, 503, None, "overloaded")
    assert (error["type"], error["code"]) == ("server_error", "overloaded")
    assert response.headers["retry-after"] == str(retry_after)


async def test_over_the_admission_limit_is_503_with_retry_after(engine_client, engine):
    client = _GatedClient(engine_client)
    app = create_openai_app(client, engine.tokenizer, MODEL, max_pending_requests=2)
    async with _http(app) as http:
        held = [
            asyncio.ensure_future(http.post("/v1/completions", json=OK)),
            asyncio.ensure_future(http.post("/v1/chat/completions", json=CHAT)),
        ]
        async with asyncio.timeout(10):
            while app.state.admission.num_pending < 2:
                await asyncio.sleep(0.005)
        for route, body in (("/v1/completions", OK), ("/v1/chat/completions", CHAT)):
            _assert_overloaded(await http.post(route, json=body))
        # the cheap routes are not counted: health checks pass under load
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/v1/models")).status_code == 200
        client.gate.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        assert app.state.admission.num_pending == 0
        assert (await http.post("/v1/completions", json=OK)).status_code == 200
    assert client.peak_active == 2



async def test_burst_of_ten_times_the_limit(engine_client, engine):
    """40 requests at once against a limit of 4: the excess is refused at once, everything
    admitted completes in full, and the engine never holds more than the limit."""
    limit = 4
    client = _GatedClient(engine_client)
    client.gate.set()
    app = create_openai_app(client, engine.tokenizer, MODEL, max_pending_requests=limit)
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 8, "ignore_eos": True, "temperature": 0}

    async def timed(i: int, http: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        start = time.monotonic()
        response = await http.post("/v1/completions", json={**body, "stream": i % 2 == 1})
        return response, time.monotonic() - start

    async with _http(app) as http:
        results = await asyncio.wait_for(asyncio.gather(*(timed(i, http) for i in range(10 * limit))), 120)
    accepted = [(r, t) for r, t in results if r.status_code == 200]
    refused = [(r, t) for r, t in results if r.status_code != 200]
    assert len(accepted) >= limit and len(refused) >= 8 * limit
    for response, _ in refused:
        _assert_overloaded(response)
    # refused at once: faster than any admitted request, which needs 8 engine steps
    assert max(t for _, t in refused) < min(t for _, t in accepted)
    for response, _ in accepted:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n")
            assert response.text.count('"finish_reason":"length"') == 1
        else:
            assert response.json()["usage"]["completion_tokens"] == 8
    assert client.peak_active <= limit
    assert app.state.admission.num_pending == 0
    # memory stays bounded: nothing left behind in the engine, every KV block free again
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_gpu_blocks() == engine.block_manager.gpu.num_blocks


async def test_a_client_that_leaves_frees_its_slot(engine_client, engine):
    app = create_openai_app(engine_client, engine.tokenizer, MODEL, max_pending_requests=1)
    long = {"model": MODEL, "prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
    request = json.dumps(long).encode()
    connection = _Connection(request, leave_after_chunks=2, how="disconnect message")
    await asyncio.wait_for(app(_scope(request), connection.receive, connection.send), 30)
    await _wait_idle(engine)
    assert app.state.admission.num_pending == 0
    async with _http(app) as http:
        assert (await http.post("/v1/completions", json=OK)).status_code == 200


# --------------------------------------------------------------------------- configuration


def test_limits_are_app_args_that_reach_the_deployments(monkeypatch):
    args = AppArgs(model="tiny-opt", device="cpu")
    assert (args.max_request_body_bytes, args.max_pending_requests, args.max_queued_requests) == (
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        DEFAULT_MAX_PENDING_REQUESTS,
        -1,
    )
    args = AppArgs(
        model="tiny-opt", device="cpu", max_request_body_bytes=4096, max_pending_requests=8, max_queued_requests=16
    )
    assert llm_server_options(args)["max_queued_requests"] == 16
    bound = record_binds(monkeypatch, args)
    http = bound["LLMServer"]["kwargs"]["http"]
    assert (http["max_request_body_bytes"], http["max_pending_requests"]) == (4096, 8)
    assert bound["LLMServer"]["options"]["max_queued_requests"] == 16
