"""The Serve side without a Ray cluster: OpenAIIngress is a late-bound Serve ingress whose
app talks to the LLMServer deployment through HandleEngineClient."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from ray import serve
from ray.serve._private.http_util import ASGIAppReplicaWrapper

from rayserve_paged.deployments.openai_ingress import HandleEngineClient, OpenAIIngress, load_tokenizer
from tests.deployments.conftest import MODEL, parse_sse
from tests.deployments.test_disconnect import _Connection, _scope, _wait_idle

pytestmark = pytest.mark.anyio


class _Method:
    def __init__(self, handle: _FakeHandle, name: str) -> None:
        self.handle, self.name = handle, name

    def remote(self, *args):
        self.handle.calls.append(self.name)
        target = getattr(self.handle.client, self.name)
        if self.handle.stream:
            return _ResponseGenerator(target(*args))
        return target(*args)  # a coroutine: awaitable like a DeploymentResponse


class _ResponseGenerator:
    """Like DeploymentResponseGenerator: async-iterable, cancel()-able."""

    def __init__(self, outputs) -> None:
        self.outputs, self.is_cancelled = outputs, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.outputs.__anext__()

    def cancel(self) -> None:
        self.is_cancelled = True


class _FakeHandle:
    """The DeploymentHandle surface HandleEngineClient uses, over an in-process client."""

    def __init__(self, client, stream: bool = False, calls: list | None = None) -> None:
        self.client, self.stream = client, stream
        self.calls = [] if calls is None else calls

    def options(self, stream: bool = False) -> _FakeHandle:
        return _FakeHandle(self.client, stream, self.calls)

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)


def _ingress(handle, tokenizer_path: str, api_key: str | None = None):
    """Build the replica object the way Serve does: the class's own __init__, then the app."""
    # the class serve.ingress wrapped (the wrapper's own __init__ / __del__ are async: Serve's)
    (user_class,) = [c for c in OpenAIIngress.__mro__ if "__serve_build_asgi_app__" in vars(c)]
    ingress = object.__new__(user_class)
    user_class.__init__(ingress, handle, tokenizer_path, MODEL, api_key)
    return ingress.__serve_build_asgi_app__()


def test_openai_ingress_is_a_late_bound_serve_ingress(tiny_opt_path):
    assert issubclass(OpenAIIngress, ASGIAppReplicaWrapper)
    assert OpenAIIngress.__name__ == "OpenAIIngress"
    deployment = serve.deployment(OpenAIIngress, name="OpenAIIngress")
    app = deployment.bind(_FakeHandle(None), tiny_opt_path, MODEL, None)
    assert isinstance(app, serve.Application)


async def test_app_through_the_handle_adapter(engine_client, tiny_opt_path):
    handle = _FakeHandle(engine_client)
    app = _ingress(handle, tiny_opt_path, api_key="sk-serve")
    assert isinstance(app, FastAPI)
    headers = {"Authorization": "Bearer sk-serve"}
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        plain = await http.post("/v1/completions", json=body, headers=headers)
        assert plain.status_code == 200, plain.text
        streamed = await http.post("/v1/completions", json={**body, "stream": True}, headers=headers)
        text = "".join(e["choices"][0]["text"] for e in parse_sse(streamed))
        assert text == plain.json()["choices"][0]["text"]
        assert (await http.get("/v1/models", headers=headers)).json()["data"][0]["id"] == MODEL
        assert (await http.post("/v1/completions", json=body)).status_code == 401
    assert {"generate", "generate_stream", "model_info"} <= set(handle.calls)


async def test_handle_stream_left_early_is_cancelled_and_aborted(engine, engine_client, tiny_opt_path):
    handle = _FakeHandle(engine_client)
    app = _ingress(handle, tiny_opt_path)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True})
    connection = _Connection(body.encode(), leave_after_chunks=3, how="disconnect message")
    await app(_scope(body.encode()), connection.receive, connection.send)
    await _wait_idle(engine)
    assert "abort" in handle.calls and len(engine_client.aborted) == 1


async def test_handle_client_cancels_an_unfinished_stream():
    class _Outputs:
        def __init__(self):
            self.count = 0

        def __aiter__(self):
            return self

        async def __anext__(self):
            self.count += 1
            return type("Out", (), {"finished": False})()

    response = _ResponseGenerator(_Outputs())

    class _Handle:
        def options(self, stream):
            return self

        @property
        def generate_stream(self):
            return type("M", (), {"remote": staticmethod(lambda *a: response)})()

    stream = HandleEngineClient(_Handle()).generate_stream("x", None, "r")
    await stream.__anext__()
    await stream.aclose()
    assert response.is_cancelled


def test_load_tokenizer_resolves_the_tiny_names_like_the_engine(engine, tiny_opt_path):
    text = "Hello world"
    assert load_tokenizer(tiny_opt_path)(text).input_ids == engine.tokenizer(text).input_ids
    assert load_tokenizer("tiny-opt")(text).input_ids == engine.tokenizer(text).input_ids  # same deterministic BPE
