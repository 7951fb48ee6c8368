"""A dying worker or scheduler actor: in-flight requests fail promptly with a clear error,
the replica reports unhealthy, Serve replaces it with fresh actors, and requests succeed again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from rayserve_paged import SamplingParams

from .test_handles import _alive, _deploy

pytestmark = pytest.mark.ray


def _pids(class_name: str) -> list[int]:
    return [a["Pid"] for a in _alive(class_name)]


def _kill_midway_and_recover(serve, app: str, victim: str, **overrides) -> dict:
    handle = _deploy(serve, app, **overrides)
    long = SamplingParams(temperature=1.0, max_tokens=2000, ignore_eos=True, seed=0)
    victims = _pids(victim)
    pid = victims[-1]

    async def stream_until_failure():
        seen, killed = 0, False
        async for out in handle.options(stream=True).generate_stream.remote("a long answer", long):
            seen += sum(len(o.token_ids) for o in out.outputs)  # deltas
            if seen >= 5 and not killed:
                os.kill(pid, signal.SIGKILL)  # the process dies while the request is running
                killed = True
        return seen

    started = time.monotonic()
    with pytest.raises(Exception) as failure:
        asyncio.run(asyncio.wait_for(stream_until_failure(), timeout=60))
    failed_after = time.monotonic() - started
    assert "fail" in str(failure.value).lower() or "died" in str(failure.value).lower()

    # the replica is unhealthy, Serve replaces it, and a request succeeds again
    recovered = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            out = handle.generate.remote("hello again", SamplingParams(temperature=0.0, max_tokens=4)).result(
                timeout_s=30
            )
            if out.finished:
                recovered = time.monotonic() - started
                break
        except Exception:
            time.sleep(1)
    assert recovered is not None, "the app did not recover"
    assert pid not in _pids(victim) and len(_pids(victim)) == len(victims)  # a fresh actor took its place
    serve.delete(app)
    return {"failed_after_s": failed_after, "recovered_after_s": recovered}


def test_killed_worker_fails_requests_then_the_replica_is_replaced(serve_session, record_property):
    # worker actors exist at TP > 1 (at TP = 1 rank 0 lives in the scheduler actor): kill rank 1
    figures = _kill_midway_and_recover(
        serve_session, "kill-worker", "WorkerActor", tensor_parallel_size=2, worker_cpus=0.3
    )
    record_property("worker_kill", figures)
    print(f"worker killed: request failed after {figures['failed_after_s']:.1f} s, "
          f"recovered after {figures['recovered_after_s']:.1f} s")  # fmt: skip


def test_killed_model_process_answers_503_retry_after_then_the_replica_serves_again(
    serve_session, serve_port, record_property
):
    """At TP = 1 the model runs in the SchedulerActor. Killed mid-request: the stream in
    flight gets an error event (engine_unavailable) and closes, the request in flight
    without streaming gets 503 + Retry-After, and so do new requests until Serve has
    replaced the replica; then requests succeed again."""
    import httpx

    from rayserve_paged.app import AppArgs, build_app

    from .test_handles import TINY

    serve_session.run(build_app(AppArgs(**(TINY | {"model": "tiny-opt"}))), name="kill-model", route_prefix="/")
    base = f"http://127.0.0.1:{serve_port}/v1/completions"
    body = {"model": "tiny-opt", "prompt": "a long answer", "max_tokens": 240, "ignore_eos": True, "temperature": 1.0}
    (pid,) = _pids("SchedulerActor")

    async def in_flight():
        async with httpx.AsyncClient(timeout=120) as client:
            plain = asyncio.ensure_future(client.post(base, json=body))
            events, killed = [], False
            async with client.stream("POST", base, json=body | {"stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) >= 5 and not killed:
                        os.kill(pid, signal.SIGKILL)  # the model process dies mid-request
                        killed = True
            return events, await plain

    started = time.monotonic()
    events, plain = asyncio.run(asyncio.wait_for(in_flight(), timeout=90))
    failed_after = time.monotonic() - started
    assert events[-1] == "[DONE]" and '"engine_unavailable"' in events[-2]  # an error event, then the end
    assert plain.status_code == 503 and plain.headers["retry-after"] == "5", plain.text
    assert plain.json()["error"]["code"] == "engine_unavailable"

    statuses = []
    recovered = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        r = httpx.post(base, json=body | {"max_tokens": 4}, timeout=60)
        statuses.append(r.status_code)
        if r.status_code == 200:
            recovered = time.monotonic() - started
            break
        assert r.status_code == 503 and "retry-after" in r.headers, (r.status_code, r.text)
        time.sleep(1)
    assert recovered is not None, f"the app did not recover: {statuses}"
    assert r.json()["usage"]["completion_tokens"] == 4
    assert pid not in _pids("SchedulerActor")  # a fresh model process took its place
    record_property("scheduler_kill", {"failed_after_s": failed_after, "recovered_after_s": recovered})
    print(f"model process killed: requests answered 503 after {failed_after:.1f} s, "
          f"recovered after {recovered:.1f} s ({len(statuses) - 1} retries answered 503)")  # fmt: skip
