"""The Serve side without a Ray cluster: LLMServer made a late-bound Serve ingress
(`serve.ingress()(LLMServer)`, as build_app does) serves the OpenAI app itself, over its
own EngineFrontend: one hop from HTTP to the replica that owns the engine."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from ray import serve
from ray.serve._private.http_util import ASGIAppReplicaWrapper

from rayserve_paged.deployments import llm_server
from rayserve_paged.deployments.llm_server import LLMServer, load_tokenizer
from rayserve_paged.engine.scheduler_actor import SchedulerActor
from tests.deployments.conftest import MODEL, parse_sse
from tests.deployments.test_disconnect import _Connection, _scope
from tests.deployments.test_llm_server import _LocalActor

pytestmark = pytest.mark.anyio


@pytest.fixture
async def replica(engine, monkeypatch):
    """An LLMServer replica object as Serve builds it: the class's __init__, then the app."""
    monkeypatch.setattr(llm_server, "ray", SimpleNamespace(get=lambda ref: ref))
    monkeypatch.setenv("RAYSERVE_PAGED_API_KEY", "sk-serve")  # the key comes from the replica's environment
    actor = SchedulerActor(engine.config, executor="in-process")
    server = LLMServer(engine.config, scheduler_actor=_LocalActor(actor), http={"served_model_name": MODEL})
    yield server, actor
    await server.frontend.close()
    actor.shutdown()
    assert not actor.engine.has_unfinished_requests()
    assert actor.engine.block_manager.num_free_gpu_blocks() == actor.engine.block_manager.gpu.num_blocks


def test_llm_server_is_a_late_bound_serve_ingress():
    ingress = serve.ingress()(LLMServer)
    assert issubclass(ingress, ASGIAppReplicaWrapper) and issubclass(ingress, LLMServer)
    app = serve.deployment(ingress, name="LLMServer").bind({"model": "tiny-opt"})
    assert isinstance(app, serve.Application)


async def test_the_replica_serves_http_and_streams_deltas(replica):
    server, _ = replica
    app = server.__serve_build_asgi_app__()
    assert isinstance(app, FastAPI)
    headers = {"Authorization": "Bearer sk-serve"}
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        plain = await http.post("/v1/completions", json=body, headers=headers)
        assert plain.status_code == 200, plain.text
        streamed = await http.post("/v1/completions", json={**body, "stream": True}, headers=headers)
        text = "".join(e["choices"][0]["text"] for e in parse_sse(streamed))
        assert text == plain.json()["choices"][0]["text"]
        assert (await http.get("/v1/models", headers=headers)).json()["data"][0]["id"] == MODEL
        assert (await http.post("/v1/completions", json=body)).status_code == 401
    # the handle API on the same object: generate is cumulative, generate_stream deltas (64
    # steps, so a step thread running ahead of a busy event loop still leaves several pieces)
    longer = {"temperature": 0, "max_tokens": 64, "ignore_eos": True}
    whole = await server.generate("Hello world", longer)
    pieces = [out async for out in server.generate_stream("Hello world", longer)]
    assert whole.outputs[0].text.startswith(text)  # greedy: the 6-token answer is its prefix
    assert whole.outputs[0].text == "".join(p.outputs[0].text for p in pieces if p.outputs)
    assert [t for p in pieces for o in p.outputs for t in o.token_ids] == whole.outputs[0].token_ids
    assert pieces[-1].finished and len(pieces) > 1


async def test_a_stream_left_early_is_aborted(replica):
    server, actor = replica
    app = server.__serve_build_asgi_app__()
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True})
    connection = _Connection(body.encode(), leave_after_chunks=3, how="disconnect message")
    scope = _scope(body.encode())
    scope["headers"].append((b"authorization", b"Bearer sk-serve"))
    await app(scope, connection.receive, connection.send)
    for _ in range(3000):
        if not actor.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not actor.engine.has_unfinished_requests()


def test_load_tokenizer_resolves_the_tiny_names_like_the_engine(engine, tiny_opt_path):
    text = "Hello world"
    assert load_tokenizer(tiny_opt_path)(text).input_ids == engine.tokenizer(text).input_ids
    assert load_tokenizer("tiny-opt")(text).input_ids == engine.tokenizer(text).input_ids  # same deterministic BPE
