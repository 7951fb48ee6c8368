"""stream_batching_interval_ms T: a stream's reader wakes at most once per T ms, the first
token and a finish at once. Under every coalescing setting the joined stream equals the
whole answer (completions and chat with n > 1, logprobs, stop strings, include_usage, tool
calls), and a finish is never held for the interval."""

from __future__ import annotations

import asyncio
import selectors

import pytest

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.frontend import DeltaBuffer, EngineFrontend
from rayserve_paged.engine.outputs import CompletionOutput, RequestOutput
from tests.deployments.conftest import MODEL, app_http, idle_client, parse_sse
from tests.deployments.engine_client import InProcessEngineClient
from tests.deployments import test_streaming as streaming
from tests.deployments.test_structured_outputs import MESSAGES, TOOLS

pytestmark = pytest.mark.anyio

NEVER = 60_000.0  # ms: longer than any test; only the first token and the end get through
SETTINGS = [(1, 0.0), (1, 20.0), (4, 20.0), (1, NEVER), (4, NEVER)]  # (stream_interval, ms)


@pytest.fixture(params=SETTINGS, ids=lambda s: f"interval{s[0]}-{s[1]:g}ms")
async def batching_client(request, engine):
    stream_interval, ms = request.param
    async with idle_client(engine, stream_interval=stream_interval, stream_batching_interval_ms=ms) as client:
        yield client


@pytest.fixture
async def batching_http(batching_client, engine):
    async with app_http(batching_client, engine) as http:
        yield http


async def test_streamed_completion_and_chat_equal_the_whole_ones(batching_http):
    await streaming.assert_streamed_completion_equals_the_whole_one(batching_http)
    await streaming.test_streamed_chat_equals_the_whole_one(batching_http)


async def test_streamed_tool_calls_equal_the_whole_ones(batching_http):
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": named, "max_tokens": 40,
            "temperature": 0}  # fmt: skip
    whole = (await batching_http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    events = parse_sse(await batching_http.post("/v1/chat/completions", json={**body, "stream": True}))
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    (call,) = whole["message"]["tool_calls"]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == call["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "tool_calls"


async def test_a_finish_is_not_held_for_the_interval(engine):
    """With an interval no test outlasts: the first token alone, then everything else with
    the finish in one delta, as soon as the engine ends the request."""
    client = InProcessEngineClient(engine, MODEL, stream_batching_interval_ms=NEVER)
    try:
        params = SamplingParams(temperature=0, max_tokens=22, ignore_eos=True)
        ids = engine.tokenizer(streaming.PROMPT).input_ids
        outs = [out async for out in client.generate_stream(ids, params, "held")]
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 21]
        assert [o.finished for o in outs] == [False, True] and outs[-1].outputs[0].finish_reason == "length"
        whole = await client.generate(ids, params, "whole")
        assert "".join(o.outputs[0].text for o in outs) == whole.outputs[0].text
    finally:
        await client.close()


async def test_an_abort_is_not_held_for_the_interval(engine):
    client = InProcessEngineClient(engine, MODEL, stream_batching_interval_ms=NEVER)
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = client.generate_stream(engine.tokenizer(streaming.PROMPT).input_ids, params, "aborted")
        first = await stream.__anext__()
        assert len(first.outputs[0].token_ids) == 1 and not first.finished
        await asyncio.sleep(0.05)  # the engine steps on; the reader is held by the interval
        await client.abort("aborted")
        last = await stream.__anext__()
        assert last.finished and last.outputs[0].finish_reason == "abort"
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    finally:
        await client.close()


def _delta(token_ids: list[int], finish_reason: str | None = None) -> RequestOutput:
    text = "".join(f"<{t}>" for t in token_ids)
    outputs = [CompletionOutput(index=0, text=text, token_ids=token_ids, cumulative_logprob=0.0, logprobs=None,
                                finish_reason=finish_reason)]  # fmt: skip
    return RequestOutput("r", None, [1], outputs, finished=finish_reason is not None)


async def test_the_buffer_holds_deltas_until_the_interval_or_the_end():
    buffer = DeltaBuffer(batching_interval_s=NEVER / 1000)
    buffer.put(_delta([1]))
    assert (await buffer.get()).outputs[0].token_ids == [1]  # the first: at once
    buffer.put(_delta([2]))
    buffer.put(_delta([3]))
    with pytest.raises(TimeoutError):  # held: the interval has not passed
        await asyncio.wait_for(buffer.get(), 0.05)
    buffer.put(_delta([4], "stop"))
    out = await buffer.get()
    assert out.finished and out.outputs[0].token_ids == [2, 3, 4] and out.outputs[0].text == "<2><3><4>"
    # a short interval: the held delta comes when its timer fires, merged
    buffer = DeltaBuffer(batching_interval_s=0.01)
    buffer.put(_delta([1]))
    await buffer.get()
    buffer.put(_delta([2]))
    buffer.put(_delta([3]))
    out = await asyncio.wait_for(buffer.get(), 5)
    assert not out.finished and out.outputs[0].token_ids == [2, 3]


def test_the_interval_must_be_finite_and_not_negative(monkeypatch):
    from pydantic import ValidationError

    from rayserve_paged.app import AppArgs
    from rayserve_paged.engine.frontend import STREAM_BATCHING_INTERVAL_MS
    from tests.deployments.conftest import record_binds

    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="stream_batching_interval_ms"):
            EngineFrontend(core=None, tokenizer=None, stream_batching_interval_ms=bad)
    for bad in (-1, float("inf")):
        with pytest.raises(ValidationError, match="stream_batching_interval_ms"):
            AppArgs(model="tiny-opt", device="cpu", stream_batching_interval_ms=bad)
    assert AppArgs(model="tiny-opt", device="cpu").stream_batching_interval_ms == STREAM_BATCHING_INTERVAL_MS
    bound = record_binds(monkeypatch, AppArgs(model="tiny-opt", device="cpu", stream_batching_interval_ms=25))
    assert bound["LLMServer"]["kwargs"]["stream_batching_interval_ms"] == 25


class _VirtualClockSelector(selectors.DefaultSelector):
    """Waiting for a timer moves the loop's clock to it instead of sleeping."""

    def __init__(self, loop: _VirtualTimeLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout=None):
        if timeout is None:
            raise AssertionError("nothing scheduled: the reader would wait forever")
        self.loop.now += timeout
        return super().select(0)


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_VirtualClockSelector(self))

    def time(self) -> float:
        return self.now


TICK = 1 / 64  # s; every time below is a whole number of ticks, exact in binary
# (tick, token id, finishes): what the engine hands the buffer, and when
PUTS = [(0, 0, False), (4, 4, False), (8, 8, False), (12, 12, False), (20, 20, False), (24, 24, False),
        (28, 28, False), (36, 36, False), (60, 60, False), (90, 90, False), (94, 94, False), (110, 110, False),
        (130, 130, False), (140, 140, True)]  # fmt: skip
PAUSES = {16: 40, 106: 20}  # tick of a read -> ticks the reader is busy after it before it reads again


def test_the_reads_keep_the_schedule_when_the_reader_is_late():
    """Interval 16 ticks. Each read is due 16 ticks after the previous one was due, not
    after it happened: the reader busy until 56 (its read due at 32) reads at 56 and next
    at 64, the first slot after 56 (not 72, nor at once at 60 to catch up); late by 4
    (due 122, read 126), it reads next at 138. Tokens that arrive after their read was
    due (90) go at once and start the schedule from there (next due 106). The first token
    and the finish go at once."""

    async def read_all() -> list[tuple[float, list[int], bool]]:
        loop = asyncio.get_running_loop()
        buffer = DeltaBuffer(batching_interval_s=16 * TICK)
        for tick, token, finishes in PUTS:
            loop.call_at(tick * TICK, buffer.put, _delta([token], "length" if finishes else None))
        reads = []
        while not reads or not reads[-1][2]:
            out = await buffer.get()
            reads.append((loop.time() / TICK, out.outputs[0].token_ids, out.finished))
            await asyncio.sleep(PAUSES.get(round(reads[-1][0]), 0) * TICK)
        return reads

    loop = _VirtualTimeLoop()
    try:
        reads = loop.run_until_complete(read_all())
    finally:
        loop.close()
    assert reads == [
        (0, [0], False), (16, [4, 8, 12], False), (56, [20, 24, 28, 36], False), (64, [60], False),
        (90, [90], False), (106, [94], False), (126, [110], False), (138, [130], False), (140, [140], True),
    ]  # fmt: skip


async def test_the_first_event_leaves_with_the_first_token_whatever_the_interval(engine):
    """TTFT under coalescing: with an interval of 60 s, the first SSE body message (the
    first token) is sent while the engine is still generating the rest, not held for the
    interval (Ray Serve LLM's first-token wait, ray-project/ray#59681)."""
    import json
    import time

    from rayserve_paged.deployments.openai_ingress import create_openai_app
    from tests.deployments.test_disconnect import _scope

    client = InProcessEngineClient(engine, MODEL, stream_batching_interval_ms=NEVER)
    app = create_openai_app(client, engine.tokenizer, MODEL)
    body = json.dumps({"model": MODEL, "prompt": streaming.PROMPT, "max_tokens": 40, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()  # fmt: skip
    chunks: list[tuple[bytes, bool]] = []  # (body, whether the engine still ran the request then)
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append((message["body"], engine.has_unfinished_requests()))

    start = time.monotonic()
    try:
        await asyncio.wait_for(app(_scope(body), receive, send), 30)
    finally:
        await client.close()
    assert time.monotonic() - start < 30  # nothing waited for the interval
    first, is_running = chunks[0]
    (event,) = [e for e in first.decode().split("\n\n") if e]
    assert is_running, "the first token was held until the request ended"
    assert json.loads(event.removeprefix("data: "))["choices"][0]["finish_reason"] is None
    text = b"".join(c for c, _ in chunks).decode()
    assert text.endswith("data: [DONE]\n\n") and len(chunks) == 2  # the first token, then the rest at the end
