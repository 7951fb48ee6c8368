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


def test_killed_scheduler_actor_fails_requests_then_the_replica_is_replaced(serve_session, record_property):
    figures = _kill_midway_and_recover(serve_session, "kill-scheduler", "SchedulerActor")
    record_property("scheduler_kill", figures)
    print(f"scheduler killed: request failed after {figures['failed_after_s']:.1f} s, "
          f"recovered after {figures['recovered_after_s']:.1f} s")  # fmt: skip
