from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from rayserve_paged.app import AppArgs, build_app
from rayserve_paged.config import EngineConfig
from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.models.tiny import make_tiny_model
from tests.deployments.engine_client import InProcessEngineClient

MODEL = "tiny-opt-test"
MAX_MODEL_LEN = 128
MAX_LOGPROBS = 5
MAX_NUM_SEQS = 8


@pytest.fixture(scope="session")
def tiny_opt_path(tmp_path_factory) -> str:
    return str(make_tiny_model("opt", tmp_path_factory.mktemp("deployments-opt")))


@pytest.fixture(scope="session")
def engine(tiny_opt_path) -> LLMEngine:
    config = EngineConfig(
        model=tiny_opt_path,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=64,
        swap_space_gb=0.01,
        max_logprobs=MAX_LOGPROBS,
        max_num_seqs=MAX_NUM_SEQS,
    )
    return LLMEngine(config)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def idle_client(engine, **options):
    """An InProcessEngineClient over `engine` (`options`: its stream intervals), closed at
    the end; every test leaves the engine idle with all KV blocks free."""
    client = InProcessEngineClient(engine, MODEL, **options)
    yield client
    await client.close()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_gpu_blocks() == engine.block_manager.gpu.num_blocks


@contextlib.contextmanager
def served_over_http(app):
    """`app` served by uvicorn on a free 127.0.0.1 port, in a background thread (its own event
    loop): yields the base URL, stops the server at the end."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def asgi_client(app, **kwargs) -> httpx.AsyncClient:
    """An HTTP client calling the ASGI app in this process."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", **kwargs)


@contextlib.asynccontextmanager
async def app_http(client, engine):
    """HTTP to the OpenAI app over `client`."""
    async with asgi_client(create_openai_app(client, engine.tokenizer, MODEL)) as http:
        yield http


@pytest.fixture
async def engine_client(engine):
    async with idle_client(engine) as client:
        yield client


@pytest.fixture
def app(engine_client, engine):
    return create_openai_app(engine_client, engine.tokenizer, MODEL)


@pytest.fixture
def hermes_app(engine_client, engine):
    """The app of a deployment that reads tool_choice "auto" calls with the hermes parser."""
    return create_openai_app(engine_client, engine.tokenizer, MODEL, tool_call_parser="hermes")


@pytest.fixture
async def http(app):
    async with asgi_client(app) as client:
        yield client


@pytest.fixture
async def hermes_http(hermes_app):
    async with asgi_client(hermes_app) as client:
        yield client


def openai_client(app) -> openai.AsyncOpenAI:
    """The official openai client over the app, in process; no retries (an error is the answer)."""
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=asgi_client(app),
                              max_retries=0)  # fmt: skip


@pytest.fixture
async def client(app):
    async with openai_client(app) as c:
        yield c


@pytest.fixture
async def hermes_client(hermes_app):
    """On the hermes deployment: tool_choice "auto" (the default with tools) is parsed there
    and refused without a parser, as vLLM's server does."""
    async with openai_client(hermes_app) as c:
        yield c


def parse_sse(response: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent event stream that must end with [DONE]."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [event for event in response.text.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def record_binds(monkeypatch, args: AppArgs | dict, build=build_app) -> dict[str, dict]:
    """build(args) (build_app's) with serve.deployment recorded: {name: {cls, options, args, kwargs}}."""
    from ray import serve

    bound: dict[str, dict] = {}

    def deployment(cls, **options):
        record = bound.setdefault(options["name"], {"cls": cls, "options": options})

        class _Deployment:
            @staticmethod
            def bind(*args, **kwargs):
                record.update(args=args, kwargs=kwargs)
                return record

        return _Deployment()

    monkeypatch.setattr(serve, "deployment", deployment)
    build(args)
    return bound
