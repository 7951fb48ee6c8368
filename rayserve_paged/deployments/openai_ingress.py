"""The OpenAI-compatible HTTP front end: FastAPI routes over an engine client.

    HTTP ──> create_openai_app(client, tokenizer, ...)   middleware, errors; the routes in
                 │                                     serving/ (one module per route family)
                 │ EngineClient (engine/protocol.py): generate / generate_stream / abort / model_info
                 ▼
             LLMServer (the replica this app runs in: deployments/llm_server.py)  in production
             an EngineFrontend over an in-process engine                          in tests

Prompts are tokenized here (in the replica's tokenizer pool, off the event loop), so usage
counts and context-length errors are exact before the engine sees a request; the engine
receives token ids. Streams read deltas: each SSE event carries what one engine step (or,
for a slow client, several) added to one request.

Limits, checked before any work (outermost first):

    API key        401   constant-time compare; /health and /metrics are open; a tenant's key
                         carries the most urgent priority it may ask for (403 past it)
    admission      503   at most `max_pending_requests` generation and tokenizer requests in
                         flight here (deployments/admission.py)
    body size      413   Content-Length first, then the bytes actually received
    body time      408   the whole body within `request_body_timeout_s` of arrival
    sequences      503   prompts x best_of within `max_pending_sequences` (400 if one request
                         alone is larger)
    tokenizer      503   at most `max_tokenizer_queue_bytes` of request bodies in tokenizer
                         jobs queued or running; a text surely longer than the context, 400
    queue time     503   the tokenized request would wait longer than `max_queue_wait_s` (the
                         estimate: work ahead / measured drain rate), or its prompt tokens
                         would pass `max_queued_prompt_tokens`; Retry-After from the estimate
    handle         503   Serve's BackPressureError (LLMServer's max_queued_requests, when set)
    starting       503   routing: prefix's ingress: no LLMServer replica runs yet and one is
                         starting (code engine_starting; deployments/ingress.py)

Every overload 503 is the same error (code "overloaded", a Retry-After header, an OpenAI
error body). Serve's own 503 (a text body, no Retry-After) comes only with max_queued_requests
>= 0 in routing: load, which the shipped configs leave at -1 (docs/DEPLOY.md, "Under load").
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import logging
import time
from collections.abc import Iterable
from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray.serve.exceptions import BackPressureError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rayserve_paged.deployments.access import DEFAULT_OPEN_PATHS
from rayserve_paged.deployments.admission import (
    DEFAULT_MAX_PENDING_REQUESTS,
    DEFAULT_MAX_PENDING_SEQUENCES,
    DEFAULT_MAX_QUEUE_WAIT_S,
    DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
    MIN_PRIORITY_SCOPE_KEY,
    SCOPE_KEY,
    AdmissionLimit,
)
from rayserve_paged.deployments.errors import (
    OpenAIError,
    RequestBodyRefused,
    RequestBodyTimeout,
    RequestBodyTooLarge,
    body_parse_error,
    engine_unavailable,
    internal_error,
    overloaded,
    validation_error,
)
from rayserve_paged.deployments.protocol import ModelCard, ModelList
from rayserve_paged.deployments.serving.chat import ChatCompletionRequest, ChatCompletionResponse, ChatServing
from rayserve_paged.deployments.serving.completions import CompletionRequest, CompletionResponse, CompletionServing
from rayserve_paged.deployments.serving.embeddings import EmbeddingRequest, EmbeddingResponse, EmbeddingServing
from rayserve_paged.deployments.serving.score import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    ScoreServing,
)
from rayserve_paged.deployments.serving.lora import LoadLoRAAdapterRequest, LoRAServing, UnloadLoRAAdapterRequest
from rayserve_paged.deployments.serving.pipeline import MAX_TOKENIZER_QUEUE_BYTES, REQUEST_BYTES, GenerationPipeline
from rayserve_paged.deployments.serving.response_store import ResponseStore, ResponseStoreConfig
from rayserve_paged.deployments.serving.responses import (
    DeletedResponse,
    InputItemList,
    ResponsesRequest,
    ResponsesServing,
)
from rayserve_paged.deployments.serving.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizationServing,
    TokenizeRequest,
    TokenizeResponse,
)
from rayserve_paged.deployments.tokenizer_pool import TokenizerPool
from rayserve_paged.engine.protocol import EngineClient
from rayserve_paged.telemetry import PROMETHEUS_CONTENT_TYPE

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20  # 1 MiB: 128 prompts of ~2k tokens fit easily
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0  # arrival to the body's last byte
SESSION_HEADER = "x-session-id"
# the session of the request being served (the engine client of a fleet's ingress reads it)
ROUTING_SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("routing_session", default=None)
# what admission counts: the routes that tokenize or generate
ADMITTED_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/score", "/v1/rerank",
    "/tokenize", "/detokenize",
})  # fmt: skip


class _APIKeyMiddleware:
    """Every route except the open ones needs `Authorization: Bearer <key>`, one of `keys`;
    the key's priority limit goes with the request (MIN_PRIORITY_SCOPE_KEY)."""

    def __init__(self, app, keys: dict[str, int | None], open_paths: frozenset[str]) -> None:
        self.app = app
        self._keys = [(key.encode(), limit) for key, limit in keys.items()]
        self._open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or _route_path(scope) in self._open_paths:
            return await self.app(scope, receive, send)
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        sent = token.strip().encode()
        # every key is compared, each in constant time: the time says nothing of which matched
        matched = [limit for key, limit in self._keys if hmac.compare_digest(sent, key)]
        if scheme.lower() == "bearer" and matched:
            scope[MIN_PRIORITY_SCOPE_KEY] = matched[0]
            return await self.app(scope, receive, send)
        error = OpenAIError(
            401,
            "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
        await error.response()(scope, receive, send)


class _AdmissionMiddleware:
    """Over the limit, a generation or tokenizer request is answered 503 at once: it never
    waits in an unbounded queue, never reads its body, never reaches the engine. An
    admitted request carries its Admission in the scope (the routes reserve its sequences
    there); the slot and the sequences come back when the answer ends, however it ends."""

    def __init__(self, app, limit: AdmissionLimit) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or _route_path(scope) not in ADMITTED_PATHS:
            return await self.app(scope, receive, send)
        if not self.limit.can_admit():
            error = overloaded(
                f"the server is overloaded: {self.limit.num_pending} requests are in flight on this "
                f"replica (the limit is {self.limit.max_pending}); retry later"
            )
            return await error.response()(scope, receive, send)
        admission = scope[SCOPE_KEY] = self.limit.admit()
        admission.min_priority = scope.get(MIN_PRIORITY_SCOPE_KEY)
        try:
            await self.app(scope, receive, send)
        finally:
            admission.release()


class _RequestBodyMiddleware:
    """The body within bounds before it is parsed.

    Size: over `max_bytes` is a 413; a declared Content-Length is checked before a byte is
    read, and the bytes received are counted as they arrive (a chunked body, or one longer
    than declared), so at most max_bytes + one chunk are held.
    Time: a body whose reads have waited `timeout_s` in all without its last byte is a 408,
    and the request ends (its admission slot comes back). Only the time spent waiting for
    the body counts, not the time this replica took before asking for it: an overloaded
    replica that reaches a request late does not blame its client, and a client that stalls
    (or trickles) still runs out of time. Once the body is complete, the connection is read
    without a deadline (a stream waits for the client leaving)."""

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            declared = declared.strip()
            if not declared.isascii() or not declared.isdigit():  # "²".isdigit(), and int() refuses it
                return await OpenAIError(400, "invalid Content-Length header").response()(scope, receive, send)
            if len(declared) > 18 or int(declared) > self.max_bytes:  # int() refuses > 4300 digits
                return await RequestBodyTooLarge(self.max_bytes).error.response()(scope, receive, send)
            REQUEST_BYTES.set(int(declared))  # what its tokenizer jobs weigh
        num_received = 0
        is_complete = False
        waited_s = 0.0  # in receive(), for the body

        async def bounded_receive():
            nonlocal num_received, is_complete, waited_s
            if is_complete:
                return await receive()
            started = time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, self.timeout_s - waited_s))
            except TimeoutError:
                raise RequestBodyTimeout(self.timeout_s) from None
            finally:
                waited_s += time.monotonic() - started
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    raise RequestBodyTooLarge(self.max_bytes)
                if num_received > REQUEST_BYTES.get():  # a chunked body, or one longer than declared
                    REQUEST_BYTES.set(num_received)
                is_complete = not message.get("more_body", False)
            else:
                is_complete = True  # the client left
            return message

        tracked = _TrackedSend(send)
        try:
            await self.app(scope, bounded_receive, tracked)
        except RequestBodyRefused as exc:  # read outside a route's body parsing
            if tracked.is_started:
                raise
            await exc.error.response()(scope, receive, send)


class _InternalErrorMiddleware:
    """An exception no handler took becomes a logged, generic OpenAI-shaped 500."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tracked = _TrackedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:
            raise  # the client left: nothing to answer, nothing went wrong here
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if tracked.is_started:
                raise
            await internal_error().response()(scope, receive, send)


def routing_session(header: str | None, user: str | None) -> str | None:
    """The session a fleet's router sticks to one replica (`x-session-id`, else the body's
    `user`), as a fixed-size digest: the router's session map holds 32 characters per
    session whatever the client sent."""
    value = header or user
    if not value:
        return None
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class _TrackedSend:
    """An ASGI `send` that knows whether the response has started (then an error can no
    longer be answered with a response of its own)."""

    def __init__(self, send) -> None:
        self.send = send
        self.is_started = False

    async def __call__(self, message) -> None:
        self.is_started = self.is_started or message["type"] == "http.response.start"
        await self.send(message)


def _route_path(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def create_openai_app(
    client: EngineClient,
    tokenizer,
    served_model_name: str,
    api_key: str | dict[str, int | None] | None = None,
    *,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
    max_pending_sequences: int = DEFAULT_MAX_PENDING_SEQUENCES,
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S,
    max_queued_prompt_tokens: int = DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
    scheduling_policy: str = "fcfs",
    max_tokenizer_queue_bytes: int = MAX_TOKENIZER_QUEUE_BYTES,
    request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S,
    enable_prompt_tokens_details: bool = False,
    open_paths: Iterable[str] = DEFAULT_OPEN_PATHS,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    tokenizer_pool: TokenizerPool | None = None,
    allow_runtime_lora_updating: bool = False,
    chat_template: str | None = None,
    responses_store: ResponseStoreConfig | dict | None = None,
) -> FastAPI:
    """The OpenAI-compatible FastAPI app over `client` (docs/API.md describes the API).
    With `api_key` (one key, or keys each with the most urgent priority it may ask for, None
    for any: deployments/access.py), every route but `open_paths` requires one. Tokenizer work runs in
    `tokenizer_pool` (the replica's; a pool of its own when None). With
    `allow_runtime_lora_updating`, POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    exist (vLLM's routes, off by default as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING). A
    `chat_template` replaces the tokenizer's (vLLM's --chat-template). `responses_store`
    bounds the stored responses of /v1/responses (ResponseStoreConfig)."""
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    serving = GenerationPipeline(
        client, tokenizer, served_model_name, max_tokenizer_queue_bytes, enable_prompt_tokens_details, tokenizer_pool
    )
    chat = ChatServing(serving, tool_call_parser, reasoning_parser)
    completion = CompletionServing(serving)
    embedding = EmbeddingServing(serving)
    scoring = ScoreServing(embedding)
    tokenization = TokenizationServing(serving, chat)
    lora = LoRAServing(serving)
    store_config = ResponseStoreConfig.model_validate(responses_store or {})
    responses = ResponsesServing(chat, ResponseStore(store_config))
    app = FastAPI(
        title="rayserve-paged",
        summary="OpenAI-compatible LLM serving with PagedAttention on Ray Serve",
    )
    app.state.serving = serving
    app.state.admission = admission = AdmissionLimit(
        max_pending_requests, max_pending_sequences, max_queue_wait_s, max_queued_prompt_tokens,
        by_priority=scheduling_policy == "priority",
    )  # fmt: skip

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(RequestBodyRefused)
    async def _body_refused(_, exc: RequestBodyRefused) -> Response:
        return exc.error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and exc.__cause__ is not None:  # the body could not be read as JSON
            return body_parse_error(exc.__cause__).response()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return OpenAIError(exc.status_code, message, type=kind).response()

    @app.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}})
    async def completions(request: CompletionRequest, http: Request) -> Response:
        ROUTING_SESSION.set(routing_session(http.headers.get(SESSION_HEADER), request.user))
        return await completion.create_completion(request, http.scope.get(SCOPE_KEY))

    @app.post("/v1/chat/completions", response_model=None, responses={200: {"model": ChatCompletionResponse}})
    async def chat_completions(request: ChatCompletionRequest, http: Request) -> Response:
        ROUTING_SESSION.set(routing_session(http.headers.get(SESSION_HEADER), request.user))
        return await chat.create_chat_completion(request, http.scope.get(SCOPE_KEY))

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, http: Request) -> EmbeddingResponse:
        return await embedding.create_embedding(request, http.scope.get(SCOPE_KEY))

    @app.post("/v1/score")
    async def score(request: ScoreRequest, http: Request) -> ScoreResponse:
        return await scoring.score(request, http.scope.get(SCOPE_KEY))

    @app.post("/v1/rerank")
    async def rerank(request: RerankRequest, http: Request) -> RerankResponse:
        return await scoring.rerank(request, http.scope.get(SCOPE_KEY))

    @app.post("/v1/responses", response_model=None)
    async def create_response(request: ResponsesRequest, http: Request) -> Response:
        # the session: the header, else `user`, else the conversation a continuation extends
        session = http.headers.get(SESSION_HEADER) or request.user or responses.conversation_of(request)
        ROUTING_SESSION.set(routing_session(session, None))
        return await responses.create_response(request, http.scope.get(SCOPE_KEY))

    @app.get("/v1/responses/{response_id}", response_model=None)
    async def get_response(response_id: str) -> Response:
        return responses.get_response(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> DeletedResponse:
        return responses.delete_response(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> InputItemList:
        return responses.input_items(response_id, limit, order, after)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return await serving.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        return await serving.model(model)

    if allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter", response_model=None)
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            return PlainTextResponse(await lora.load_lora_adapter(request))

        @app.post("/v1/unload_lora_adapter", response_model=None)
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            return PlainTextResponse(await lora.unload_lora_adapter(request))

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        """Prometheus text of every LLMServer replica, merged (each series has a `replica` label)."""
        return Response(await serving.client.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/health", response_model=None)
    async def health() -> Response:
        if await serving.is_healthy():
            return JSONResponse({"status": "ok"})
        return engine_unavailable("the engine is not healthy").response()

    # the last added runs first: API key, admission, internal errors, body size and time, the routes
    app.add_middleware(_RequestBodyMiddleware, max_bytes=max_request_body_bytes, timeout_s=request_body_timeout_s)
    app.add_middleware(_InternalErrorMiddleware)
    app.add_middleware(_AdmissionMiddleware, limit=admission)
    _add_api_key_check(app, api_key, open_paths)
    return app


def _add_api_key_check(app: FastAPI, api_key: str | dict[str, int | None] | None, open_paths: Iterable[str]) -> None:
    """The API-key middleware for a key, or for {key: min_priority} (none: every route open)."""
    keys = ({api_key: None} if api_key else {}) if isinstance(api_key, str) else dict(api_key or {})
    if keys:
        app.add_middleware(_APIKeyMiddleware, keys=keys, open_paths=frozenset(open_paths))


def add_request_guards(
    app: FastAPI,
    api_key: str | dict[str, int | None] | None,
    open_paths: Iterable[str] = DEFAULT_OPEN_PATHS,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S,
) -> None:
    """create_openai_app's API key, internal-error and body checks (outermost first) on an
    app of another shape: the multi-model ingress, which reads a body to choose its model's
    app (deployments/multi_model.py)."""
    app.add_middleware(_RequestBodyMiddleware, max_bytes=max_request_body_bytes, timeout_s=request_body_timeout_s)
    app.add_middleware(_InternalErrorMiddleware)
    _add_api_key_check(app, api_key, open_paths)
