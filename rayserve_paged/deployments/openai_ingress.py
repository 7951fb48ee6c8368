"""The OpenAI-compatible HTTP front end: FastAPI routes over an engine client.

    HTTP ──> create_openai_app(client, tokenizer, ...)   validate, tokenize, SSE, errors
                 │ EngineClient: generate / generate_stream / abort / model_info
                 ▼
             LLMServer (the replica this app runs in: deployments/llm_server.py)  in production
             an EngineFrontend over an in-process engine                          in tests

Prompts are tokenized here (in a thread pool, off the event loop), so usage
counts and context-length errors are exact before the engine sees a request; the engine
receives token ids. Streams read deltas: each SSE event carries what one engine step (or,
for a slow client, several) added to one request.

Limits, checked before any work (outermost first):

    API key        401   constant-time compare; /health is open
    admission      503   at most `max_pending_requests` generation requests in flight here
    body size      413   Content-Length first, then the bytes actually received
    handle         503   Serve's BackPressureError (LLMServer's max_queued_requests)

Both 503s are the same error (code "overloaded", a Retry-After header), like Serve's own.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray.serve.exceptions import BackPressureError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rayserve_paged.deployments.access import DEFAULT_OPEN_PATHS
from rayserve_paged.deployments.errors import (
    OpenAIError,
    RequestBodyTooLarge,
    body_parse_error,
    engine_unavailable,
    internal_error,
    overloaded,
    validation_error,
)
from rayserve_paged.deployments.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from rayserve_paged.deployments.serving import EngineClient, OpenAIServing
from rayserve_paged.telemetry import PROMETHEUS_CONTENT_TYPE

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20  # 1 MiB: 128 prompts of ~2k tokens fit easily
DEFAULT_MAX_PENDING_REQUESTS = 256  # per replica
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # what admission counts


class _APIKeyMiddleware:
    """Every route except the open ones needs `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._key = api_key.encode()
        self._open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or _route_path(scope) in self._open_paths:
            return await self.app(scope, receive, send)
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key):
            return await self.app(scope, receive, send)
        error = OpenAIError(
            401,
            "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
        await error.response()(scope, receive, send)


@dataclass(slots=True)
class AdmissionLimit:
    """Generation requests in flight in this ingress replica, from arrival until the last
    byte of the answer (a stream included) or the client leaving."""

    max_pending: int
    num_pending: int = 0

    def can_admit(self) -> bool:
        return self.num_pending < self.max_pending


class _AdmissionMiddleware:
    """Over the limit, a generation request is answered 503 at once: it never waits in an
    unbounded queue, never reads its body, never reaches the engine."""

    def __init__(self, app, limit: AdmissionLimit) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or _route_path(scope) not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if not self.limit.can_admit():
            error = overloaded(
                f"the server is overloaded: {self.limit.num_pending} requests are in flight on this "
                f"replica (the limit is {self.limit.max_pending}); retry later"
            )
            return await error.response()(scope, receive, send)
        self.limit.num_pending += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.limit.num_pending -= 1


class _BodySizeLimitMiddleware:
    """A body over `max_bytes` is a 413 before it is parsed: a declared Content-Length is
    checked before a byte is read, and the bytes received are counted as they arrive (a
    chunked body, or one longer than declared), so at most max_bytes + one chunk are held."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return await OpenAIError(400, "invalid Content-Length header").response()(scope, receive, send)
            if int(declared) > self.max_bytes:
                return await RequestBodyTooLarge(self.max_bytes).error.response()(scope, receive, send)
        num_received = 0

        async def counting_receive():
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    raise RequestBodyTooLarge(self.max_bytes)
            return message

        is_started = False

        async def tracking_send(message) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except RequestBodyTooLarge as exc:  # read outside a route's body parsing
            if is_started:
                raise
            await exc.error.response()(scope, receive, send)


class _InternalErrorMiddleware:
    """An exception no handler took becomes a logged, generic OpenAI-shaped 500."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        is_started = False

        async def tracking_send(message) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            raise  # the client left: nothing to answer, nothing went wrong here
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if is_started:
                raise
            await internal_error().response()(scope, receive, send)


def _route_path(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def create_openai_app(
    client: EngineClient,
    tokenizer,
    served_model_name: str,
    api_key: str | None = None,
    *,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
    open_paths: Iterable[str] = DEFAULT_OPEN_PATHS,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible FastAPI app over `client` (docs/API.md describes the API).
    With `api_key`, every route but `open_paths` requires it."""
    serving = OpenAIServing(client, tokenizer, served_model_name, tool_call_parser)
    app = FastAPI(
        title="rayserve-paged",
        summary="OpenAI-compatible LLM serving with PagedAttention on Ray Serve",
    )
    app.state.serving = serving
    app.state.admission = admission = AdmissionLimit(max_pending_requests)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(RequestBodyTooLarge)
    async def _body_too_large(_, exc: RequestBodyTooLarge) -> Response:
        return exc.error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and exc.__cause__ is not None:  # the body could not be read as JSON
            return body_parse_error(exc.__cause__).response()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return OpenAIError(exc.status_code, message, type=kind).response()

    @app.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}})
    async def completions(request: CompletionRequest) -> Response:
        return await serving.create_completion(request)

    @app.post("/v1/chat/completions", response_model=None, responses={200: {"model": ChatCompletionResponse}})
    async def chat_completions(request: ChatCompletionRequest) -> Response:
        return await serving.create_chat_completion(request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.detokenize(request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return await serving.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        return await serving.model(model)

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        """Prometheus text of every LLMServer replica, merged (each series has a `replica` label)."""
        return Response(await serving.client.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/health", response_model=None)
    async def health() -> Response:
        if await serving.is_healthy():
            return JSONResponse({"status": "ok"})
        return engine_unavailable("the engine is not healthy").response()

    # the last added runs first: API key, admission, internal errors, body size, the routes
    app.add_middleware(_BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    app.add_middleware(_InternalErrorMiddleware)
    app.add_middleware(_AdmissionMiddleware, limit=admission)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, open_paths=frozenset(open_paths))
    return app
