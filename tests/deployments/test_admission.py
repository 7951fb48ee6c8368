"""Admission weighs work: a request takes prompts x best_of sequences of the replica's
budget, /tokenize and /detokenize take admission slots and share a bounded tokenizer queue,
and a request whose body stalls is a 408 that frees its slot. Every refusal is prompt, and
the server serves the next request."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from rayserve_paged.app import AppArgs
from rayserve_paged.deployments.openai_ingress import create_openai_app
from tests.deployments.conftest import MODEL, assert_openai_error, parse_sse, record_binds
from tests.deployments.test_disconnect import _scope
from tests.deployments.test_limits import CHAT, OK, _assert_overloaded, _call, _GatedClient, _http

pytestmark = pytest.mark.anyio


async def _until(condition, timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def test_one_request_of_8_prompts_x_n4_takes_32_sequences(engine_client, engine):
    client = _GatedClient(engine_client)
    app = create_openai_app(client, engine.tokenizer, MODEL, max_pending_sequences=33)
    admission = app.state.admission
    batch = {**OK, "prompt": [f"p{i}" for i in range(8)], "n": 4}
    async with _http(app) as http:
        held = asyncio.ensure_future(http.post("/v1/completions", json=batch))
        await _until(lambda: admission.num_sequences == 32)
        assert admission.num_pending == 1
        # 2 more do not fit while the 32 run: 503 at once; 1 more does
        _assert_overloaded(await http.post("/v1/chat/completions", json={**CHAT, "n": 2}))
        _assert_overloaded(await http.post("/v1/completions", json={**OK, "best_of": 2}))
        one = asyncio.ensure_future(http.post("/v1/completions", json=OK))
        await _until(lambda: admission.num_sequences == 33)
        client.gate.set()
        response, single = await asyncio.gather(held, one)
        assert len(response.json()["choices"]) == 32 and single.status_code == 200
        assert (admission.num_pending, admission.num_sequences) == (0, 0)
        # alone over the whole budget: a 400 naming the field, retrying cannot help
        too_many = {**batch, "prompt": [f"p{i}" for i in range(9)]}
        assert_openai_error(await http.post("/v1/completions", json=too_many), 400, "prompt", "36 sequences")
        assert_openai_error(await http.post("/v1/completions", json={**OK, "n": 2, "best_of": 34}), 400, "best_of")
        stream = await http.post("/v1/completions", json={**batch, "stream": True})
        assert len({c["index"] for e in parse_sse(stream) for c in e["choices"]}) == 32
        assert (admission.num_pending, admission.num_sequences) == (0, 0)


async def test_beam_search_takes_its_width(engine_client, engine):
    client = _GatedClient(engine_client)
    app = create_openai_app(client, engine.tokenizer, MODEL)
    beams = {**OK, "use_beam_search": True, "n": 2, "best_of": 3, "temperature": 0}
    async with _http(app) as http:
        held = asyncio.ensure_future(http.post("/v1/completions", json=beams))
        await _until(lambda: app.state.admission.num_sequences == 3)
        client.gate.set()
        assert len((await held).json()["choices"]) == 2
    assert app.state.admission.num_sequences == 0


async def test_tokenize_and_detokenize_take_admission_slots(engine_client, engine):
    client = _GatedClient(engine_client)
    app = create_openai_app(client, engine.tokenizer, MODEL, max_pending_requests=1)
    async with _http(app) as http:
        held = asyncio.ensure_future(http.post("/v1/completions", json=OK))
        await _until(lambda: app.state.admission.num_pending == 1)
        _assert_overloaded(await http.post("/tokenize", json={"prompt": "Hello"}))
        _assert_overloaded(await http.post("/detokenize", json={"tokens": [5, 6]}))
        assert (await http.get("/health")).status_code == 200
        client.gate.set()
        assert (await held).status_code == 200
        assert (await http.post("/tokenize", json={"prompt": "Hello"})).json()["count"] > 0
        assert (await http.post("/detokenize", json={"tokens": [5, 6]})).status_code == 200
    assert app.state.admission.num_pending == 0


async def test_a_full_tokenizer_queue_is_503_with_retry_after(engine_client, engine, monkeypatch):
    # the held job's body is 17 bytes, each other one's at least 14: 31 bytes are past the bound
    app = create_openai_app(engine_client, engine.tokenizer, MODEL, max_tokenizer_queue_bytes=30)
    serving = app.state.serving
    released = threading.Event()
    call = type(engine.tokenizer).__call__

    def slow(self, text, *args, **kwargs):
        if text == "SLOW":
            released.wait(30)
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(engine.tokenizer), "__call__", slow)
    async with _http(app) as http:
        held = asyncio.ensure_future(http.post("/tokenize", json={"prompt": "SLOW"}))
        await _until(lambda: serving.num_tokenizer_jobs == 1)
        for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]}), ("/v1/completions", OK)):
            response = await http.post(route, json=body)
            _assert_overloaded(response)
            assert "tokenizer jobs" in response.json()["error"]["message"]
        released.set()
        assert (await held).json()["count"] > 0
        await _until(lambda: serving.num_tokenizer_jobs == 0)
        assert (await http.post("/v1/completions", json=OK)).status_code == 200


async def _send_half_a_body(app, body: bytes) -> tuple[int, dict]:
    """A client that sends half its body, then nothing (and never leaves)."""
    sent: list[dict] = []
    chunks = [{"type": "http.request", "body": body[: len(body) // 2], "more_body": True}]

    async def receive() -> dict:
        if chunks:
            return chunks.pop()
        await asyncio.sleep(3600)

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(_scope(body), receive, send), 10)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


async def test_a_stalled_body_is_a_408_that_frees_its_slot(engine_client, engine):
    app = create_openai_app(engine_client, engine.tokenizer, MODEL, max_pending_requests=2, request_body_timeout_s=0.2)
    body = json.dumps(OK).encode()
    loop = asyncio.get_running_loop()
    start = loop.time()
    results = await asyncio.gather(_send_half_a_body(app, body), _send_half_a_body(app, body))
    assert loop.time() - start < 5
    for status, answer in results:
        assert (status, answer["error"]["code"]) == (408, "request_timeout")
        assert "0.2 s" in answer["error"]["message"]
    assert app.state.admission.num_pending == 0
    async with _http(app) as http:  # both slots are free again
        responses = await asyncio.gather(*(http.post("/v1/completions", json=OK) for _ in range(2)))
        assert [r.status_code for r in responses] == [200, 200]


async def test_the_body_deadline_does_not_cut_a_long_answer(engine_client, engine):
    """Past the whole body, the connection is read without a deadline: a stream (which
    waits on it for the client leaving) outlives request_body_timeout_s."""
    client = _GatedClient(engine_client)
    app = create_openai_app(client, engine.tokenizer, MODEL, request_body_timeout_s=0.1)
    async with _http(app) as http:
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, client.gate.set)
        stream = await http.post("/v1/completions", json={**OK, "stream": True, "ignore_eos": True})
        assert parse_sse(stream)[-1]["choices"][0]["finish_reason"] == "length"
        assert (await http.post("/v1/completions", json=OK)).status_code == 200


async def test_a_content_length_int_cannot_parse_is_a_4xx(engine_client, engine):
    app = create_openai_app(engine_client, engine.tokenizer, MODEL)
    for value in ("²".encode("latin-1"), "³".encode("latin-1"), b"1_0", b"-1"):  # "²".isdigit() is true
        status, body, _ = await _call(app, [b"{}"], [(b"content-length", value)])
        assert status == 400 and "Content-Length" in body["error"]["message"]
    status, body, num_read = await _call(app, [b"{}"], [(b"content-length", b"9" * 5000)])  # past int()'s limit
    assert (status, body["error"]["code"], num_read) == (413, "request_too_large", 0)
    async with _http(app) as http:
        assert (await http.post("/v1/completions", json=OK)).status_code == 200


def test_the_admission_and_usage_options_reach_the_app(monkeypatch):
    args = AppArgs(model="tiny-opt", device="cpu")
    assert (args.max_pending_sequences, args.max_tokenizer_queue_bytes, args.request_body_timeout_s) == (
        4096, 8 << 20, 30.0
    )
    assert (args.max_queue_wait_s, args.max_queued_prompt_tokens, args.scheduling_policy) == (300.0, 1 << 20, "fcfs")
    assert args.enable_prompt_tokens_details is False
    options = {
        "max_pending_sequences": 48,
        "max_tokenizer_queue_bytes": 4096,
        "max_queue_wait_s": 7.5,
        "max_queued_prompt_tokens": 1000,
        "scheduling_policy": "priority",
        "request_body_timeout_s": 2.5,
        "enable_prompt_tokens_details": True,
    }
    http = record_binds(monkeypatch, AppArgs(model="tiny-opt", device="cpu", **options))["LLMServer"]["kwargs"]["http"]
    assert {k: http[k] for k in options} == options
