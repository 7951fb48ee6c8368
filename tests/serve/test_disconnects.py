"""100 streaming HTTP clients that disconnect at random points: afterwards every KV block is
free on the GPU pool and the CPU pool, and the next requests are served correctly."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from rayserve_paged.app import AppArgs, build_app

from .test_handles import TINY

pytestmark = pytest.mark.ray


def test_random_disconnects_leave_no_blocks_behind(serve_session, serve_port):
    # one event per token (no time-based coalescing), so that a client can cut any stream
    # after exactly `cut` events
    args = AppArgs(**(TINY | {"model": "tiny-opt", "stream_batching_interval_ms": 0}))
    serve_session.run(build_app(args), name="leak", route_prefix="/")
    base = f"http://127.0.0.1:{serve_port}"
    llm = serve_session.get_deployment_handle("LLMServer", app_name="leak")
    rng = random.Random(3)
    cut_points = [rng.randint(1, 40) for _ in range(100)]
    body = {"model": "tiny-opt", "prompt": "tell me a long story", "max_tokens": 200, "ignore_eos": True,
            "stream": True, "temperature": 1.0}  # fmt: skip

    async def one(client: httpx.AsyncClient, limit: asyncio.Semaphore, cut: int) -> int:
        async with limit:
            events = 0
            async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events += 1
                        if events >= cut:
                            break  # leaving the block drops the connection mid-stream
            return events

    async def run() -> list[int]:
        limit = asyncio.Semaphore(10)
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[one(client, limit, cut) for cut in cut_points])

    received = asyncio.run(run())
    assert received == cut_points  # every client read exactly as far as it meant to
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = llm.stats.remote().result()
        if stats["num_unfinished_requests"] == 0:
            break
        time.sleep(0.5)
    assert stats == stats | {"num_unfinished_requests": 0, "gpu_blocks_used": 0, "cpu_blocks_used": 0}
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny-opt", "prompt": "after", "max_tokens": 5, "ignore_eos": True,
                                                   "temperature": 0}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
