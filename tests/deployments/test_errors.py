"""Bad input is a 4xx in OpenAI's shape that names the problem, and the server keeps
serving; unexpected failures are a generic 500; the API key guards every route but /health.

BAD_REQUESTS is the table of distinct invalid requests: each must be a 4xx (never a 5xx)
whose error names the field at fault, and a valid request must succeed right after it."""

from __future__ import annotations

import httpx
import pytest

from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.engine.outputs import RequestOutput
from tests.deployments.conftest import MAX_LOGPROBS, MAX_MODEL_LEN, MAX_NUM_SEQS, MODEL, assert_openai_error

pytestmark = pytest.mark.anyio

OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (name, route, body (dict or raw bytes), status, param, words in the message)
C, CHAT_ROUTE = "/v1/completions", "/v1/chat/completions"
ONE_MIB = 1 << 20
BAD_REQUESTS = [
    ("malformed json", C, b'{"prompt": "Hi", ', 400, None, ["invalid JSON"]),
    ("not an object", C, b"[1, 2]", 400, None, []),
    ("wrong type", C, {**OK, "max_tokens": "many"}, 400, "max_tokens", ["integer"]),
    ("missing prompt", C, {"model": MODEL}, 400, "prompt", ["required"]),
    ("negative max_tokens", C, {**OK, "max_tokens": -5}, 400, "max_tokens", [">= 1"]),
    ("best_of < n", C, {**OK, "n": 3, "best_of": 2}, 400, "best_of", [">= n"]),
    ("greedy n > 1", C, {**OK, "n": 2, "temperature": 0}, 400, "n", ["greedy"]),
    ("n too large", C, {**OK, "n": 17}, 400, "n", ["16"]),
    ("temperature < 0", C, {**OK, "temperature": -0.5}, 400, "temperature", [">= 0"]),
    ("top_p > 1", C, {**OK, "top_p": 1.5}, 400, "top_p", ["(0, 1]"]),
    ("unknown model", C, {**OK, "model": "gpt-4"}, 404, "model", ["gpt-4"]),
    ("too many stops", C, {**OK, "stop": [f"s{i}" for i in range(17)]}, 400, "stop", ["16"]),
    ("empty stop", C, {**OK, "stop": [""]}, 400, "stop", ["non-empty"]),
    ("logprobs too large", C, {**OK, "logprobs": MAX_LOGPROBS + 1}, 400, "logprobs", ["at most"]),
    ("token outside vocab", C, {**OK, "prompt": [1, 99999]}, 400, "prompt", ["vocabulary"]),
    ("negative token", C, {**OK, "prompt": [[5, -1]]}, 400, "prompt", ["vocabulary"]),
    ("prompt too long", C, {**OK, "prompt": [5] * MAX_MODEL_LEN}, 400, "prompt", ["context length"]),
    (
        "prompt + max_tokens too long",
        C,
        {**OK, "prompt": [5] * (MAX_MODEL_LEN - 4), "max_tokens": 10},
        400,
        "max_tokens",
        ["at most 4"],
    ),
    ("empty prompt", C, {**OK, "prompt": ""}, 400, "prompt", ["empty"]),
    ("empty prompt list", C, {**OK, "prompt": []}, 400, "prompt", ["empty"]),
    ("empty token list", C, {**OK, "prompt": [[1], []]}, 400, "prompt", ["empty"]),
    ("prompt_logprobs over max", C, {**OK, "prompt_logprobs": 99}, 400, "prompt_logprobs", ["at most"]),
    ("stream best_of > n", C, {**OK, "best_of": 2, "stream": True}, 400, "best_of", ["stream"]),
    ("stream_options alone", C, {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options", []),
    ("beam sampling", C, {**OK, "use_beam_search": True, "n": 2, "temperature": 0.7}, 400, "temperature", ["beam"]),
    ("beam stream", C, {**OK, "use_beam_search": True, "n": 2, "stream": True}, 400, "use_beam_search", []),
    # rejected by the engine (best_of > max_num_seqs), not by the ingress: still a 400, also streamed
    ("engine rejects", C, {**OK, "n": MAX_NUM_SEQS + 1}, 400, "n", ["max_num_seqs"]),
    ("engine rejects stream", C, {**OK, "n": MAX_NUM_SEQS + 1, "stream": True}, 400, "n", []),
    ("chat no messages", CHAT_ROUTE, {**CHAT, "messages": []}, 400, "messages", []),
    ("chat bad role", CHAT_ROUTE, {**CHAT, "messages": [{"role": "x", "content": "y"}]}, 400, "messages[0].role", []),
    ("chat top_logprobs alone", CHAT_ROUTE, {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", ["logprobs"]),
    (
        "chat top_logprobs large",
        CHAT_ROUTE,
        {**CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
        400,
        "top_logprobs",
        ["at most"],
    ),
    ("chat zero max tokens", CHAT_ROUTE, {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", []),
    # the body itself
    ("non-UTF-8 body", C, b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, None, ["invalid JSON body", "UTF-8"]),
    ("JSON nested too deeply", C, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None, ["nested"]),
    ("empty body", C, b"", 400, None, ["required"]),
    ("JSON null body", C, b"null", 400, None, ["dictionary"]),
    ("oversize body", C, b'{"prompt": "' + b"x" * ONE_MIB + b'"}', 413, None, [str(ONE_MIB), "bytes"]),
    ("NaN temperature", C, b'{"prompt": "Hi", "temperature": NaN}', 400, "temperature", ["finite"]),
    ("lone surrogate in prompt", C, b'{"prompt": "a\\ud800"}', 400, "prompt", ["Unicode", "U+D800"]),
    # wrong types (strict: nothing is coerced)
    ("max_tokens a bool", C, {**OK, "max_tokens": True}, 400, "max_tokens", ["integer"]),
    ("max_tokens a float", C, {**OK, "max_tokens": 2.5}, 400, "max_tokens", ["integer"]),
    ("n a string", C, {**OK, "n": "2"}, 400, "n", ["integer"]),
    ("stream a string", C, {**OK, "stream": "yes"}, 400, "stream", ["boolean"]),
    ("model not a string", C, {**OK, "model": 5}, 400, "model", ["string"]),
    ("prompt a number", C, {**OK, "prompt": 5}, 400, "prompt", ["must be"]),
    ("prompt of bools", C, {**OK, "prompt": [True, False]}, 400, "prompt", ["must be"]),
    ("prompt of floats", C, {**OK, "prompt": [1.5]}, 400, "prompt", ["must be"]),
    ("prompt nested too deep", C, {**OK, "prompt": [[[1]]]}, 400, "prompt", ["integers"]),
    ("prompt mixes kinds", C, {**OK, "prompt": ["a", [1]]}, 400, "prompt", ["mix"]),
    ("too many prompts", C, {**OK, "prompt": ["a"] * 129}, 400, "prompt", ["128"]),
    ("early_stopping unknown", C, {**OK, "early_stopping": "sometimes"}, 400, "early_stopping", ["never"]),
    ("seed a string", C, {**OK, "seed": "x"}, 400, "seed", ["integer"]),
    # values out of range
    ("huge max_tokens", C, {**OK, "max_tokens": 10**30}, 400, "max_tokens", ["context length"]),
    ("zero max_tokens", C, {**OK, "max_tokens": 0}, 400, "max_tokens", ["echo"]),
    ("n zero", C, {**OK, "n": 0}, 400, "n", ["greater than or equal to 1"]),
    ("best_of too large", C, {**OK, "best_of": 17}, 400, "best_of", ["16"]),
    ("top_p zero", C, {**OK, "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    ("top_k below -1", C, {**OK, "top_k": -2}, 400, "top_k", ["-1"]),
    ("min_p above 1", C, {**OK, "min_p": 2}, 400, "min_p", ["[0, 1]"]),
    ("presence_penalty out of range", C, {**OK, "presence_penalty": 3}, 400, "presence_penalty", ["[-2, 2]"]),
    ("frequency_penalty out of range", C, {**OK, "frequency_penalty": -3}, 400, "frequency_penalty", ["[-2, 2]"]),
    ("repetition_penalty zero", C, {**OK, "repetition_penalty": 0}, 400, "repetition_penalty", ["> 0"]),
    ("seed too large", C, {**OK, "seed": 2**64}, 400, "seed", ["less than"]),
    ("negative stop token", C, {**OK, "stop_token_ids": [-1]}, 400, "stop_token_ids", ["non-negative"]),
    ("too many stop tokens", C, {**OK, "stop_token_ids": list(range(65))}, 400, "stop_token_ids", ["64"]),
    ("negative logprobs", C, {**OK, "logprobs": -1}, 400, "logprobs", ["greater than or equal to 0"]),
    ("huge logprobs", C, {**OK, "logprobs": 10**9}, 400, "logprobs", ["at most"]),
    ("length_penalty out of range", C, {**OK, "length_penalty": 1e308}, 400, "length_penalty", ["10"]),
    # beam search with options it cannot use
    ("beam with top_k", C, {**OK, "use_beam_search": True, "n": 2, "top_k": 5}, 400, "top_k", ["beam"]),
    ("beam with top_p", C, {**OK, "use_beam_search": True, "n": 2, "top_p": 0.5}, 400, "top_p", ["beam"]),
    ("beam with min_p", C, {**OK, "use_beam_search": True, "n": 2, "min_p": 0.1}, 400, "min_p", ["beam"]),
    ("beam of width 1", C, {**OK, "use_beam_search": True}, 400, "n", ["beam width"]),
    # chat
    ("chat unknown model", CHAT_ROUTE, {**CHAT, "model": "gpt-4o"}, 404, "model", ["gpt-4o"]),
    ("chat missing messages", CHAT_ROUTE, {"model": MODEL}, 400, "messages", ["required"]),
    ("chat messages a string", CHAT_ROUTE, {**CHAT, "messages": "Hi"}, 400, "messages", ["list"]),
    (
        "chat content a number",
        CHAT_ROUTE,
        {**CHAT, "messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
        ["string"],
    ),
    (
        "chat content missing",
        CHAT_ROUTE,
        {**CHAT, "messages": [{"role": "user"}]},
        400,
        "messages[0]",
        ["content", "required"],
    ),
    (
        "chat image part",
        CHAT_ROUTE,
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content",
        ["'text'"],
    ),
    (
        "chat lone surrogate",
        CHAT_ROUTE,
        b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
        400,
        "messages[0].content",
        ["Unicode"],
    ),
    (
        "chat prompt too long",
        CHAT_ROUTE,
        {**CHAT, "messages": [{"role": "user", "content": "hello " * 200}]},
        400,
        "messages",
        ["context length"],
    ),
    ("chat logprobs not a bool", CHAT_ROUTE, {**CHAT, "logprobs": 3}, 400, "logprobs", ["boolean"]),
    (
        "chat top_logprobs above 20",
        CHAT_ROUTE,
        {**CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        ["20"],
    ),
    ("chat negative max_tokens", CHAT_ROUTE, {**CHAT, "max_tokens": -1}, 400, "max_tokens", [">= 1"]),
    ("response_format unknown type", CHAT_ROUTE, {**CHAT, "response_format": {"type": "xml"}}, 400,
     "response_format.type", ["'json_schema'"]),
    ("response_format json_schema without its schema", CHAT_ROUTE, {**CHAT, "response_format": {"type": "json_schema"}},
     400, "response_format", ["json_schema: required"]),
    ("logit_bias key not an id", C, {**OK, "logit_bias": {"x": 1}}, 400, "logit_bias", ["token ids"]),
    ("logit_bias out of range", C, {**OK, "logit_bias": {"5": 101}}, 400, "logit_bias", ["[-100, 100]"]),
    ("logit_bias outside vocab", C, {**OK, "logit_bias": {"99999": 1}}, 400, "logit_bias", ["vocabulary"]),
    ("min_tokens > max_tokens", C, {**OK, "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens", ["max_tokens"]),
    ("assistant content null without tool_calls", CHAT_ROUTE,
     {**CHAT, "messages": [{"role": "assistant", "content": None}]}, 400, "messages[0]", ["content"]),
]
_CODES = {404: "model_not_found", 413: "request_too_large"}


def test_the_table_has_at_least_30_distinct_cases():
    assert len({name for name, *_ in BAD_REQUESTS}) == len(BAD_REQUESTS) >= 30
    assert len({(route, repr(body)) for _, route, body, *_ in BAD_REQUESTS}) == len(BAD_REQUESTS)


@pytest.mark.parametrize(
    ("route", "body", "status", "param", "words"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
async def test_bad_request_then_a_good_one(http, route, body, status, param, words):
    if isinstance(body, bytes):
        response = await http.post(route, content=body, headers={"content-type": "application/json"})
    else:
        response = await http.post(route, json=body)
    error = assert_openai_error(response, status, param, *words)
    assert error["type"] == "invalid_request_error"
    assert error["code"] == _CODES.get(status)
    good = await http.post(route, json=OK if route == C else CHAT)
    assert good.status_code == 200, good.text


async def test_unknown_route_is_openai_shaped(http):
    assert_openai_error(await http.get("/v1/engines"), 404)
    assert_openai_error(await http.get("/v1/completions"), 405)


class _ScriptedClient:
    """A pure fake: answers with whatever it was scripted to, or raises."""

    def __init__(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error, self.aborted = result, error, []

    async def generate(self, prompt, sampling_params, request_id):
        if self.error is not None:
            raise self.error
        return self.result

    async def generate_stream(self, prompt, sampling_params, request_id):
        if self.error is not None:
            raise self.error
        yield self.result

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def model_info(self):
        return {"model": MODEL, "max_model_len": MAX_MODEL_LEN, "vocab_size": 512, "max_logprobs": 5}


class _WrappedEngineError(ValueError):
    """Like Ray's RayTaskError: a ValueError whose str() is a traceback; `.cause` is the original."""

    def __init__(self, cause: Exception) -> None:
        super().__init__("Traceback (most recent call last): ... long remote traceback ...")
        self.cause = cause


def _app(client, tokenizer, api_key=None):
    app = create_openai_app(client, tokenizer, MODEL, api_key=api_key)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_failures(engine, stream):
    ignored = RequestOutput("r", None, [], [], finished=True, error="the request can never fit in the KV cache")
    cases = [
        (_ScriptedClient(result=ignored), 400, "KV cache"),
        (_ScriptedClient(error=_WrappedEngineError(ValueError("prompt_token_ids: 7 is bad"))), 400, "7 is bad"),
        (_ScriptedClient(error=RuntimeError("secret internals")), 500, "internal server error"),
    ]
    for client, status, words in cases:
        async with _app(client, engine.tokenizer) as http:
            response = await http.post("/v1/completions", json={**OK, "stream": stream})
        error = assert_openai_error(response, status, None, words)
        assert "secret" not in error["message"] and "Traceback" not in error["message"]
        assert client.aborted  # whatever failed was aborted
    assert error["type"] == "server_error"


async def test_api_key(engine_client, engine):
    async with _app(engine_client, engine.tokenizer, api_key="sk-test") as http:
        error = assert_openai_error(await http.post("/v1/completions", json=OK), 401)
        assert error["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer sk-wrong"}
        assert_openai_error(await http.post("/v1/completions", json=OK, headers=wrong), 401)
        # the key is checked before the body is even parsed
        assert_openai_error(await http.post("/v1/completions", content=b"{", headers=wrong), 401)
        assert_openai_error(await http.get("/v1/models"), 401)
        assert (await http.get("/health")).status_code == 200
        right = {"Authorization": "Bearer sk-test"}
        assert (await http.post("/v1/completions", json=OK, headers=right)).status_code == 200
        assert (await http.get("/v1/models", headers=right)).status_code == 200


async def test_unexpected_failure_is_a_generic_500_and_the_engine_down_a_503(engine):
    class _BrokenTokenizer:
        chat_template = None

        def __call__(self, text, **kwargs):
            raise RuntimeError("secret tokenizer internals")

    async with _app(_ScriptedClient(), _BrokenTokenizer()) as http:
        error = assert_openai_error(await http.post("/v1/completions", json=OK), 500)
        assert error["type"] == "server_error" and "secret" not in error["message"]

    class _DownClient(_ScriptedClient):
        async def model_info(self):
            raise ConnectionError("replica gone")

    async with _app(_DownClient(), engine.tokenizer) as http:
        assert assert_openai_error(await http.post("/v1/completions", json=OK), 503)["code"] == "engine_unavailable"
        assert_openai_error(await http.get("/health"), 503)
