"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis, in-process, no network).

Every operation of `app.openapi()` gets valid and invalid requests generated from the
schema (huge numbers, wrong types, missing fields, boundary values ...). Each must be
answered, within REQUEST_TIMEOUT_S, with a 2xx or with a 4xx in OpenAI's error shape: never
a 5xx, never a hang. Hypothesis leaves lone surrogates out of generated text, which JSON can
carry as escapes ("\\ud800"), so a second test puts any code point into every text field.
The schema run is repeated with the API key set (and sent), so the key middleware sits in
front of every route as in a keyed deployment.

The engine client validates each request with the real engine (`add_request`: vocabulary,
context length, logprobs and max_num_seqs limits), aborts it at once and answers two
synthetic tokens, so the run spends its time on the HTTP paths rather than on the model.
Runs are derandomized: the same examples every time, so CI cannot flake on a new seed.
"""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
import schemathesis
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.engine.outputs import CompletionOutput, RequestOutput
from tests.deployments.conftest import MODEL

MAX_EXAMPLES = 50  # per operation (schemathesis adds its own boundary-value cases)
API_KEY = "sk-fuzz-31c7"
REQUEST_TIMEOUT_S = 10.0

SCHEMA = schemathesis.openapi.from_dict(create_openai_app(None, None, MODEL).openapi())


class _ValidatingClient:
    """An EngineClient: the engine's own validation, then two synthetic tokens per choice."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # touched only from the portal's event loop thread

    async def generate(self, prompt: list[int], sampling_params: SamplingParams, request_id: str) -> RequestOutput:
        self.engine.add_request(request_id, None, sampling_params, prompt_token_ids=prompt)
        self.engine.abort_request(request_id)
        return self._output(request_id, prompt, sampling_params)

    async def generate_stream(self, prompt, sampling_params, request_id):
        yield await self.generate(prompt, sampling_params, request_id)

    async def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    async def model_info(self) -> dict:
        return {
            "model": MODEL,
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.model_config.vocab_size,
            "max_logprobs": self.engine.config.max_logprobs,
        }

    async def metrics_text(self) -> str:
        return ""

    def _output(self, request_id: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
        num_tokens = min(params.max_tokens or 2, 2)
        token_ids = [(prompt[0] + i) % self.engine.model_config.vocab_size for i in range(num_tokens)]
        logprobs = None
        if params.logprobs is not None:
            logprobs = [{t: -0.5, **{(t + 1 + k) % 64: -1.0 - k for k in range(params.logprobs)}} for t in token_ids]
        text = self.engine.tokenizer.decode(token_ids)
        outputs = [
            CompletionOutput(i, text, list(token_ids), -1.0, logprobs, finish_reason="length") for i in range(params.n)
        ]
        return RequestOutput(request_id, None, prompt, outputs, finished=True)


def _sender(engine, api_key: str | None = None):
    """send(case) -> httpx.Response, through the app on one event loop (a blocking portal);
    with `api_key`, the app requires it and every request carries it."""
    client = _ValidatingClient(engine)
    app = create_openai_app(client, engine.tokenizer, MODEL, api_key=api_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def request(kwargs: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as http:
            with anyio.fail_after(REQUEST_TIMEOUT_S):  # a hang fails the test, it does not stall it
                return await http.request(**kwargs)

    with start_blocking_portal() as portal:
        yield lambda kwargs: portal.call(request, kwargs)
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def send(engine):
    yield from _sender(engine)


@pytest.fixture(scope="module")
def send_with_key(engine):
    yield from _sender(engine, API_KEY)


def _httpx_kwargs(case) -> dict:
    kwargs = case.as_transport_kwargs(base_url="http://test")
    headers = {k: v for k, v in kwargs["headers"].items() if k.lower() != "content-length"}
    request = {"method": kwargs["method"], "url": kwargs["url"], "headers": headers, "params": kwargs.get("params")}
    if "json" in kwargs:  # ASCII-escaped, so lone surrogates reach the server as JSON escapes
        request["content"] = json.dumps(kwargs["json"]).encode()
    elif kwargs.get("data") is not None:
        data = kwargs["data"]
        request["content"] = data if isinstance(data, bytes) else str(data).encode()
    return request


_FUZZ = settings(
    max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
_ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # surrogates included


@SCHEMA.parametrize()
@_FUZZ
def test_schema_fuzz_never_5xx_never_hangs(case, send):
    _check(send(_httpx_kwargs(case)), case.path)


@SCHEMA.parametrize()
@settings(_FUZZ, max_examples=MAX_EXAMPLES // 2)
def test_schema_fuzz_with_the_api_key_set(case, send_with_key):
    """Every route again behind the key middleware, the key sent: past it, still no 5xx."""
    response = send_with_key(_httpx_kwargs(case))
    assert response.status_code != 401, f"{case.path}: the key was refused"
    _check(response, case.path)


@settings(_FUZZ, max_examples=3 * MAX_EXAMPLES)  # cheap: one small request each
@given(
    text=_ANY_TEXT,
    where=st.sampled_from(
        ["prompt", "prompt list", "stop", "stop list", "user", "model", "logit_bias key", "chat content",
         "chat part", "chat name", "tool_call_id", "tool_calls", "tools"]
    ),
    stream=st.booleans(),
)
def test_any_code_point_in_any_text_field(send, text, where, stream):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": stream}
    completion = {"prompt": "Hi", "max_tokens": 2, "stream": stream}
    body, path = {
        "prompt": ({**completion, "prompt": text}, "/v1/completions"),
        "prompt list": ({**completion, "prompt": ["Hi", text]}, "/v1/completions"),
        "stop": ({**completion, "stop": text}, "/v1/completions"),
        "stop list": ({**completion, "stop": ["x", text]}, "/v1/completions"),
        "user": ({**completion, "user": text}, "/v1/completions"),
        "model": ({**completion, "model": text}, "/v1/completions"),
        "chat content": ({**chat, "messages": [{"role": "user", "content": text}]}, "/v1/chat/completions"),
        "chat part": (
            {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
            "/v1/chat/completions",
        ),
        "chat name": ({**chat, "messages": [{"role": "user", "content": "Hi", "name": text}]}, "/v1/chat/completions"),
        "logit_bias key": ({**completion, "logit_bias": {text: 1.0}}, "/v1/completions"),
        "tool_call_id": (
            {**chat, "messages": [*chat["messages"], {"role": "tool", "content": "1", "tool_call_id": text}]},
            "/v1/chat/completions",
        ),
        "tool_calls": (
            {**chat, "messages": [{"role": "assistant", "tool_calls": [{"id": text, text: text}]}]},
            "/v1/chat/completions",
        ),
        "tools": ({**chat, "tools": [{"type": "function", "function": {"name": text}}]}, "/v1/chat/completions"),
    }[where]
    content = json.dumps(body).encode()  # ASCII: a lone surrogate travels as a JSON escape
    _check(send({"method": "POST", "url": path, "content": content, "headers": _JSON}), path)


_JSON = {"content-type": "application/json"}


def _check(response: httpx.Response, path: str) -> None:
    assert response.status_code < 500, f"{path}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif response.headers["content-type"].startswith("text/event-stream") and path == "/v1/responses":
        # typed events (`event:` and `data:` lines), ending with the response's own end, as OpenAI's (no [DONE])
        events = [json.loads(e.split("\ndata: ", 1)[1]) for e in response.text.split("\n\n") if e]
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), response.text[-500:]
        assert all(e["type"] != "response.failed" for e in events), response.text[:500]
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
        assert events[-1] == "[DONE]", response.text[-500:]
        assert all("error" not in json.loads(e) for e in events[:-1]), response.text[:500]
    elif path != "/metrics":
        response.json()
