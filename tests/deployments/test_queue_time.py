"""Queue, then shed by time: a replica queues what the estimate says will be served within
max_queue_wait_s and sheds the rest with 503 + Retry-After (from the estimate) and an
OpenAI error body; priorities decide who is shed; tenants' keys bound their priority; a
flood of large /tokenize bodies leaves completions served."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from rayserve_paged.deployments.admission import AdmissionLimit
from rayserve_paged.deployments.openai_ingress import create_openai_app
from tests.deployments.conftest import MAX_MODEL_LEN, MODEL, assert_openai_error
from tests.deployments.test_admission import _until
from tests.deployments.test_limits import OK, _GatedClient, _http

pytestmark = pytest.mark.anyio


def _clock(step_s: float = 1.0):
    """A clock that moves `step_s` at every reading: each request's span is busy time."""
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


def _limit(**options) -> AdmissionLimit:
    return AdmissionLimit(100, clock=_clock(), max_queue_wait_s=options.pop("max_queue_wait_s", 10), **options)


def _run(limit: AdmissionLimit, work: int, priority: int = 0):
    admission = limit.admit()
    admission.reserve_work(work // 2, work, priority)
    return admission


def _shed(limit: AdmissionLimit, work: int, priority: int = 0) -> int:
    """The Retry-After of a request that must be shed."""
    admission = limit.admit()
    with pytest.raises(Exception) as refused:
        admission.reserve_work(work // 2, work, priority)
    admission.release()
    error = refused.value
    assert (error.status_code, error.info.code) == (503, "overloaded"), error
    assert "max_queue_wait_s" in error.info.message or "max_queued_prompt_tokens" in error.info.message
    return int(error.headers["Retry-After"])


def test_nothing_is_shed_by_time_before_the_rate_is_measured():
    limit = _limit(max_queue_wait_s=0.001)
    held = [_run(limit, 1000) for _ in range(50)]  # a cold replica queues them all
    assert limit.num_work == 50_000 and limit.rate is None
    for admission in held:
        admission.release()
    assert (limit.num_work, limit.num_prompt_tokens, limit.num_pending) == (0, 0, 0)


def test_the_rate_is_work_per_busy_second_and_sheds_past_the_bound():
    limit = _limit()
    _run(limit, 100).release()  # busy from t=0 to t=1: 100 tokens of work per second
    assert limit.rate == 100
    first = _run(limit, 500)  # nothing ahead: always admitted (t=2)
    held = [_run(limit, 400), _run(limit, 100)]  # 5 s, then 9 s ahead of them
    assert limit.estimated_wait_s() == 10
    held.append(_run(limit, 100))  # 10 s ahead: not over the bound
    assert _shed(limit, 1) == 1  # 11 s ahead: 1 s past it
    first.release()  # t=3: 500 tokens in the second busy second, smoothed with the first
    assert limit.rate == 0.5 * 500 + 0.5 * 100
    for admission in held:
        admission.release()
    assert (limit.num_work, limit.num_prompt_tokens, limit.num_pending) == (0, 0, 0)
    idle_rate = limit.rate
    for _ in range(5):
        limit.clock()  # idle seconds are not busy seconds: the rate does not decay
    _run(limit, 2 * int(idle_rate)).release()  # one busy second at twice the rate
    assert limit.rate == 0.5 * 2 * int(idle_rate) + 0.5 * idle_rate


def test_retry_after_is_the_excess_of_the_estimate():
    limit = _limit(max_queue_wait_s=2)
    _run(limit, 10).release()
    assert limit.rate == 10
    held = _run(limit, 100)  # 10 s of work ahead of the next: 8 s past the bound
    assert _shed(limit, 1) == 8
    held.release()


def test_under_priority_the_least_urgent_are_shed_first():
    limit = _limit(max_queue_wait_s=5, by_priority=True)
    _run(limit, 10, priority=10).release()
    flood = [_run(limit, 60, priority=10)]  # 6 s of priority-10 work
    assert _shed(limit, 10, priority=10) >= 1  # another priority-10 request waits too long
    urgent = _run(limit, 10, priority=0)  # nothing at least as urgent is ahead: admitted
    assert limit.estimated_wait_s(0) == 1 and limit.estimated_wait_s(10) == 7
    for admission in (*flood, urgent):
        admission.release()
    # fcfs: the engine ignores priority, so the estimate does too
    limit = _limit(max_queue_wait_s=5)
    _run(limit, 10).release()
    held = _run(limit, 60, priority=10)
    assert _shed(limit, 10, priority=0) >= 1
    held.release()


def test_queued_prompt_tokens_are_bounded():
    limit = _limit(max_prompt_tokens=100)
    held = _run(limit, 160)  # 80 prompt tokens
    assert _shed(limit, 60) >= 1  # 30 more would pass 100 (no rate yet: Retry-After 1)
    small = _run(limit, 40)  # 20 more fit
    held.release()
    small.release()
    assert limit.num_prompt_tokens == 0
    alone = _run(limit, 10_000)  # larger than the bound, but nothing queued: admitted
    alone.release()


# ---------------------------------------------------------------- over HTTP


async def test_a_sustained_overload_is_answered_in_full_or_503_then_service_resumes(engine_client, engine):
    app = create_openai_app(engine_client, engine.tokenizer, MODEL, max_queue_wait_s=0.5)
    app.state.admission.clock = _clock()
    body = {**OK, "max_tokens": 4, "ignore_eos": True}  # unseeded draws may end a request early
    statuses = []
    async with _http(app) as http:
        for _ in range(4):  # waves of 12 at once: the engine runs 8 at a time
            responses = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12)))
            for response in responses:
                statuses.append(response.status_code)
                if response.status_code == 200:
                    (choice,) = response.json()["choices"]
                    assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == 4
                else:
                    error = assert_openai_error(response, 503, None, "max_queue_wait_s")
                    assert (error["type"], error["code"]) == ("server_error", "overloaded")
                    assert int(response.headers["retry-after"]) >= 1
        assert statuses.count(503) >= 12 and statuses.count(200) >= 4, statuses
        limit = app.state.admission
        assert (limit.num_pending, limit.num_work, limit.num_prompt_tokens) == (0, 0, 0)
        for _ in range(3):  # afterwards, one at a time: nothing ahead, each served
            assert (await http.post("/v1/completions", json=body)).status_code == 200


async def test_priority_decides_who_is_shed_over_http(engine_client, engine):
    client = _GatedClient(engine_client)
    app = create_openai_app(client, engine.tokenizer, MODEL, max_queue_wait_s=1, scheduling_policy="priority")
    limit = app.state.admission
    limit.clock = _clock()
    lazy = {**OK, "priority": 10}
    async with _http(app) as http:
        client.gate.set()
        assert (await http.post("/v1/completions", json=lazy)).status_code == 200  # W tokens in one busy second
        client.gate.clear()
        # the second of the flood finds 1 s of work ahead (admitted), the third 2 s: shed
        flood = [asyncio.ensure_future(http.post("/v1/completions", json=lazy)) for _ in range(2)]
        await _until(lambda: client.num_active == 2)
        response = await http.post("/v1/completions", json=lazy)
        assert_openai_error(response, 503, None, "max_queue_wait_s")
        assert int(response.headers["retry-after"]) >= 1
        # nothing at least as urgent as priority 0 is ahead: admitted past the flood
        urgent = asyncio.ensure_future(http.post("/v1/completions", json={**OK, "priority": 0}))
        await _until(lambda: client.num_active == 3)
        client.gate.set()
        assert [r.status_code for r in await asyncio.gather(urgent, *flood)] == [200, 200, 200]
    assert limit.num_work == 0


async def test_a_tenant_key_cannot_ask_past_its_priority_limit(engine):
    seen: list[int] = []

    class Recording:
        def __init__(self, inner) -> None:
            self.inner = inner

        async def generate(self, prompt, params, request_id):
            seen.append(params.priority)
            return await self.inner.generate(prompt, params, request_id)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    from tests.deployments.conftest import idle_client

    async with idle_client(engine) as inner:
        keys = {"batch-key": 10, "ops-key": None, "keen-key": -5}
        app = create_openai_app(Recording(inner), engine.tokenizer, MODEL, keys, scheduling_policy="priority")
        async with _http(app) as http:

            def post(key, **fields):
                return http.post("/v1/completions", json={**OK, **fields}, headers={"authorization": f"Bearer {key}"})

            error = assert_openai_error(await post("batch-key", priority=0), 403, "priority", "10")
            assert error["type"] == "permission_error"
            assert (await post("batch-key")).status_code == 200  # unset: the key's limit
            assert (await post("batch-key", priority=12)).status_code == 200
            assert (await post("ops-key", priority=-100)).status_code == 200  # no limit
            assert (await post("ops-key")).status_code == 200
            assert (await post("keen-key")).status_code == 200  # unset: 0 (its limit is more urgent)
            assert (await post("keen-key", priority=-5)).status_code == 200
            assert (await post("other-key")).status_code == 401
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 3}
            r = await http.post("/v1/chat/completions", json=chat, headers={"authorization": "Bearer batch-key"})
            assert_openai_error(r, 403, "priority")
        assert seen == [10, 12, -100, 0, 0, -5]


async def test_a_flood_of_large_tokenize_bodies_leaves_completions_served(engine_client, engine):
    app = create_openai_app(engine_client, engine.tokenizer, MODEL)
    big = {"prompt": "word " * 180_000}  # 900 kB: far more than MAX_MODEL_LEN tokens
    async with _http(app) as http:
        assert (await http.get("/v1/models")).status_code == 200
        loop = asyncio.get_running_loop()
        start = loop.time()
        floods = [asyncio.ensure_future(http.post("/tokenize", json=big)) for _ in range(16)]
        completions = [asyncio.ensure_future(http.post("/v1/completions", json=OK)) for _ in range(8)]
        for response in await asyncio.gather(*floods):
            if response.status_code != 503:  # a full tokenizer queue is a fair answer too
                assert_openai_error(response, 400, "prompt", "maximum context length")
        assert [r.status_code for r in await asyncio.gather(*completions)] == [200] * 8
        assert loop.time() - start < 30
        # within the character bound but past the context: capped like a prompt
        response = await http.post("/tokenize", json={"prompt": "word " * (MAX_MODEL_LEN + 8)})
        assert_openai_error(response, 400, "prompt", "maximum context length")
        assert (await http.post("/tokenize", json={"prompt": "word " * 8})).status_code == 200
        # a completion prompt surely past the context is refused before it is tokenized
        response = await http.post("/v1/completions", json={**OK, "prompt": "word " * 50_000})
        assert_openai_error(response, 400, "prompt", "characters")


def test_the_tenant_keys_file_maps_keys_to_limits_and_cannot_fail_open(tmp_path, caplog):
    import json
    import logging

    from rayserve_paged.deployments.access import API_KEY_ENV, API_KEYS_FILE_ENV, replica_api_keys

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-batch": {"min_priority": 10}, " sk-ops ": {"min_priority": None}, "sk-x": {}}))
    caplog.set_level(logging.WARNING, logger="rayserve_paged.deployments.access")
    keys = replica_api_keys(True, {API_KEYS_FILE_ENV: str(path)})  # the file alone satisfies require_api_key
    assert keys == {"sk-batch": 10, "sk-ops": None, "sk-x": None} and caplog.records == []
    assert replica_api_keys(False, {API_KEYS_FILE_ENV: str(path), API_KEY_ENV: "sk-root"})["sk-root"] is None
    assert replica_api_keys(False, {}) == {} and "every route is open" in caplog.records[-1].getMessage()
    for bad in ("[]", "{}", "not json", json.dumps({"k": {"min_priority": "0"}}), json.dumps({"k": {"min_priority": True}}),
                json.dumps({" ": {}}), json.dumps({"k": 3})):  # fmt: skip
        path.write_text(bad)
        with pytest.raises(RuntimeError, match=API_KEYS_FILE_ENV) as refused:
            replica_api_keys(False, {API_KEYS_FILE_ENV: str(path)})
        assert "sk-" not in str(refused.value)
    with pytest.raises(RuntimeError, match="cannot read"):
        replica_api_keys(False, {API_KEYS_FILE_ENV: str(tmp_path / "missing.json")})


async def test_a_replica_that_reads_a_body_late_does_not_answer_408():
    """Under overload a replica may reach a request's body long after it arrived; only the
    time spent waiting for the body counts against request_body_timeout_s."""
    from rayserve_paged.deployments.openai_ingress import _RequestBodyMiddleware
    from tests.deployments.test_disconnect import _scope

    got = []

    async def late_reader(scope, receive, send):
        await asyncio.sleep(0.5)  # busy elsewhere: past the 0.2 s of the timeout
        got.append(await receive())

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    app = _RequestBodyMiddleware(late_reader, max_bytes=100, timeout_s=0.2)
    await app(_scope(b"{}"), receive, lambda message: asyncio.sleep(0))
    assert got == [{"type": "http.request", "body": b"{}", "more_body": False}]
