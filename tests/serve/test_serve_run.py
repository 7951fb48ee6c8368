"""`serve run configs/tiny.yaml` in a subprocess, driven with the official openai client."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import REPO

pytestmark = pytest.mark.ray


def _serve_bin() -> str:
    return str(Path(sys.executable).with_name("serve"))


def _wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve run exited early with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError("the app did not become healthy")


@contextlib.contextmanager
def served_config(name: str, ray_cluster: str, port: int, tmp_dir: Path):
    """`serve run configs/<name>` on the session cluster's Serve port (Serve has one HTTP proxy
    port per cluster: if an earlier test started Serve, `serve run` keeps that port); yields
    the base URL once healthy; SIGTERM and delete afterwards."""
    config = (REPO / "configs" / name).read_text().replace("port: 8000", f"port: {port}")
    path = tmp_dir / name
    path.write_text(config)
    env = dict(os.environ, RAY_ADDRESS=ray_cluster)
    log = open(path.with_suffix(".log"), "w")
    proc = subprocess.Popen([_serve_bin(), "run", str(path)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)  # `serve run` in the background ignores SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        from ray import serve

        for app_name in list(serve.status().applications):
            serve.delete(app_name)


@pytest.fixture(scope="module")
def tiny_server(ray_cluster, serve_port, tmp_path_factory):
    with served_config("tiny.yaml", ray_cluster, serve_port, tmp_path_factory.mktemp("serve")) as base:
        yield base


@pytest.fixture(scope="module")
def client(tiny_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{tiny_server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_tiny_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny-opt"]


def test_completion_and_usage(client):
    r = client.completions.create(model="tiny-opt", prompt="The paged KV cache", max_tokens=8, temperature=0)
    assert len(r.choices) == 1 and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens >= 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_completion_equals_the_whole(client):
    kwargs = dict(model="tiny-opt", prompt="Once upon a time", max_tokens=48, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(pieces) == whole and len(pieces) > 1


def test_n_logprobs_stop_and_seed(client):
    r = client.completions.create(model="tiny-opt", prompt="Hello", max_tokens=6, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    again = client.completions.create(model="tiny-opt", prompt="Hello", max_tokens=6, n=2, temperature=1.0, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    lp = client.completions.create(model="tiny-opt", prompt="Hello", max_tokens=4, logprobs=2, temperature=0)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    text = client.completions.create(model="tiny-opt", prompt="Hello", max_tokens=16, temperature=0).choices[0].text
    if len(text) > 4:
        stop = text[2:4]
        cut = client.completions.create(model="tiny-opt", prompt="Hello", max_tokens=16, temperature=0, stop=[stop])
        assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_chat_completion(client):
    r = client.chat.completions.create(
        model="tiny-opt", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, temperature=0
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1


def test_bad_request_is_an_openai_error_and_serving_goes_on(client):
    from openai import BadRequestError, NotFoundError

    with pytest.raises(BadRequestError):
        client.completions.create(model="tiny-opt", prompt="x", max_tokens=-1)
    with pytest.raises(NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert client.completions.create(model="tiny-opt", prompt="x", max_tokens=2).choices


def test_metrics_are_scraped_from_the_running_app(tiny_server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="tiny-opt", prompt="count me", max_tokens=4)
    r = httpx.get(f"{tiny_server}/metrics", timeout=30)
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    finished = [s for s in families["rayserve_paged_request_finished"].samples if s.name.endswith("_total")]
    assert sum(s.value for s in finished) >= 1 and all(s.labels.get("replica") for s in finished)
    usage = families["rayserve_paged_kv_cache_usage"].samples
    assert {s.labels["pool"] for s in usage} == {"device", "cpu"}  # a CPU run has no "gpu" pool


def test_a_burst_of_1000_simultaneous_requests_is_queued_and_answered_in_full(tiny_server, client):
    """configs/tiny.yaml as shipped: Serve never answers first (no text 503) and the replica
    queues the burst (the engine runs 64 at a time) instead of shedding it."""
    import asyncio

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=tiny_server, limits=limits, timeout=300, trust_env=False) as http:
            body = {"model": "tiny-opt", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(1000)))

    responses = asyncio.run(burst())
    failed = [(r.status_code, r.headers.get("retry-after"), r.text[:200]) for r in responses if r.status_code != 200]
    assert not failed, f"{len(failed)} of 1000 not answered: {failed[:3]}"
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in responses)
    assert client.completions.create(model="tiny-opt", prompt="after", max_tokens=2).choices  # service goes on
