"""Several models behind one OpenAI ingress (Ray Serve LLM's `llm_configs`, app.build_openai_app).

    HTTP ─> Serve proxy ─> OpenAIIngress (MultiModelIngress)
                              API key, body size and time (add_request_guards)
                              ModelDispatch: the body's `model` -> that model's OpenAI app
                                ├─ model a: create_openai_app over RoutedEngineClient ─> LLMServer:a replicas
                                └─ model b: create_openai_app over RoutedEngineClient ─> LLMServer:b replicas
                              GET /v1/models (all), /health (all), /metrics (the application's)

Each model keeps everything of its own: tokenizer, admission limits, tool-call parser, LoRA
adapters, and its LLMServer deployment (its autoscaling, its placement groups, and under
`routing: prefix` its PrefixAffinityRouter, which sees only that model's replicas). Only
the HTTP front door is shared.

`model` names a model by its id, or one of its LoRA adapters by name; a name
`<model_id>:<anything>` goes to that model (Ray Serve LLM's adapter ids), whose app answers
404 when it holds no such adapter. With one model, a request without `model` goes to it;
with several, that is a 400 (as Ray Serve LLM).

The body is read (within the body size and time limits) before the model's app sees it:
the model decides which admission limit counts the request. The model's app then parses
the same bytes again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from rayserve_paged.deployments.access import replica_api_key
from rayserve_paged.deployments.errors import OpenAIError, bad_request, engine_unavailable
from rayserve_paged.deployments.fleet_metrics import METRICS_CACHE_S, FleetMetricsCache
from rayserve_paged.deployments.ingress import FleetReadiness, RoutedEngineClient
from rayserve_paged.deployments.llm_server import LLMServer, load_tokenizer
from rayserve_paged.deployments.openai_ingress import add_request_guards, create_openai_app
from rayserve_paged.deployments.protocol import ModelList
from rayserve_paged.telemetry import PROMETHEUS_CONTENT_TYPE

ASGIApp = Callable[..., Awaitable[None]]

# the routes whose body's `model` chooses the app (every other route but OWN_ROUTES: the first model's)
MODEL_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
OWN_ROUTES = frozenset({"/v1/models", "/health", "/metrics"})  # answered for all models at once
MODEL_PATH = "/v1/models/"
MAX_NAME_CHARS = 128  # of a `model` quoted back in an error


class ModelServer(LLMServer):
    """A model's LLMServer behind the multi-model ingress under `routing: load` (Serve's own
    router): no HTTP app here, no routing report."""

    serves_http = False


@dataclass(slots=True)
class ServedModel:
    """What the ingress holds of one model: its OpenAI app (over its engine client)."""

    app: FastAPI
    adapters: tuple[str, ...]  # its LoRA adapters' names

    @property
    def serving(self):
        return self.app.state.serving


class ModelDispatch:
    """ASGI middleware of the ingress app: a request for one model goes to that model's app;
    the ingress's own routes (OWN_ROUTES) go on to the ingress app."""

    def __init__(self, app: ASGIApp, models: Mapping[str, ServedModel]) -> None:
        self.app = app
        self.models = dict(models)
        self.default = next(iter(self.models))  # answers what names no model (404s, body errors)
        self.adapters = {name: model_id for model_id, m in self.models.items() for name in m.adapters}

    def model_of(self, name: str) -> str | None:
        """The model id `name` (a model, one of its adapters, or `<model_id>:...`) is served by."""
        if name in self.models:
            return name
        if name in self.adapters:
            return self.adapters[name]
        base, sep, _ = name.partition(":")
        return base if sep and base in self.models else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        path = path[len(root) :] if root and path.startswith(root) else path
        if path in OWN_ROUTES:
            return await self.app(scope, receive, send)
        if path.startswith(MODEL_PATH):
            return await self._to_model(path[len(MODEL_PATH) :], scope, receive, send)
        if path in MODEL_ROUTES and scope.get("method") == "POST":
            body, is_complete = await read_body(receive)
            if not is_complete:
                return  # the client left before its body arrived: nobody to answer
            replay = replayed(body, receive)
            name = model_field(body)
            if name is None:
                if len(self.models) > 1:
                    error = bad_request(
                        f"model: required: this server serves several models ({', '.join(self.models)})", param="model"
                    )
                    return await error.response()(scope, replay, send)
                return await self.models[self.default].app(scope, replay, send)
            if not isinstance(name, str):  # the model's app answers the validation error
                return await self.models[self.default].app(scope, replay, send)
            return await self._to_model(name, scope, replay, send)
        return await self.models[self.default].app(scope, receive, send)

    async def _to_model(self, name: str, scope, receive, send) -> None:
        model_id = self.model_of(name)
        if model_id is None:
            shown = name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."
            error = OpenAIError(
                404,
                f"the model {shown!r} does not exist; this server serves {', '.join(repr(m) for m in self.models)} "
                "and their LoRA adapters (GET /v1/models lists them)",
                param="model",
                code="model_not_found",
            )
            return await error.response()(scope, receive, send)
        await self.models[model_id].app(scope, receive, send)


async def read_body(receive) -> tuple[bytes, bool]:
    """The whole request body (the guards' receive bounds its size and time), and whether
    it arrived whole (False: the client left)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), True


def replayed(body: bytes, receive):
    """A receive that hands `body` over once, then what the connection says (a disconnect)."""
    is_sent = False

    async def receive_again():
        nonlocal is_sent
        if is_sent:
            return await receive()
        is_sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again


def model_field(body: bytes):
    """The body's `model` (None when absent, or when the body is no JSON object: the model's
    app answers that body's error)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return data.get("model") if isinstance(data, dict) else None


def create_multi_model_app(
    models: Mapping[str, ServedModel],
    api_key: str | None = None,
    *,
    open_paths=None,
    max_request_body_bytes: int | None = None,
    request_body_timeout_s: float | None = None,
) -> FastAPI:
    """The ingress app over each model's OpenAI app (built with no API key: it is checked
    here, before a body is read)."""
    app = FastAPI(title="rayserve-paged", summary="OpenAI-compatible LLM serving with PagedAttention on Ray Serve")
    served = list(models.values())

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, exc: OpenAIError) -> Response:
        return exc.response()

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        lists = await asyncio.gather(*(m.serving.models() for m in served))
        return ModelList(data=[card for models_list in lists for card in models_list.data])

    @app.get("/health", response_model=None)
    async def health() -> Response:
        healthy = await asyncio.gather(*(m.serving.is_healthy() for m in served))
        if all(healthy):
            return JSONResponse({"status": "ok"})
        sick = [model_id for model_id, ok in zip(models, healthy, strict=True) if not ok]
        return engine_unavailable(f"the engine of {', '.join(sick)} is not healthy").response()

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        """Prometheus text of every LLMServer replica of the application, every model's (each
        series has a `replica` label), and this ingress's routing decisions."""
        return Response(await served[0].serving.client.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    app.add_middleware(ModelDispatch, models=models)
    guards = {
        k: v
        for k, v in (
            ("open_paths", open_paths),
            ("max_request_body_bytes", max_request_body_bytes),
            ("request_body_timeout_s", request_body_timeout_s),
        )
        if v is not None
    }
    add_request_guards(app, api_key, **guards)
    return app


def _no_router(app_name: str) -> int:
    """The replicas routable by a router of this process: none counted (the controller's
    counts of each model's deployment decide readiness; the routers of several models share
    one application name)."""
    return 0


class MultiModelIngress:
    """The HTTP deployment of a multi-model application (build_openai_app makes it a Serve
    ingress). `models`: one dict per model, in llm_configs order: model_id, handle (its
    LLMServer deployment), deployment_name, tokenizer, trust_remote_code, block_size,
    lora_modules, http (its create_openai_app options; the API key and body options are
    the application's, the same in every model's)."""

    def __init__(self, models: list[dict], metrics_cache_s: float = METRICS_CACHE_S) -> None:
        from ray import serve

        context = serve.get_replica_context()
        metrics = FleetMetricsCache(context.app_name, metrics_cache_s)  # one scrape covers every model
        first = dict(models[0]["http"])
        self._api_key = replica_api_key(first.get("require_api_key", False))
        self._guards = {k: first[k] for k in ("open_paths", "max_request_body_bytes", "request_body_timeout_s")}
        self._models = []
        for model in models:
            readiness = FleetReadiness(context.app_name, model["deployment_name"], num_routable=_no_router)
            client = RoutedEngineClient(
                model["handle"], model["block_size"], metrics, context.replica_id.unique_id, model["lora_modules"],
                readiness,
            )  # fmt: skip
            tokenizer = load_tokenizer(model["tokenizer"], model["trust_remote_code"])
            self._models.append((model, client, tokenizer))

    def __serve_build_asgi_app__(self):
        served = {}
        for model, client, tokenizer in self._models:
            http = {k: v for k, v in model["http"].items() if k != "require_api_key"}  # the key is checked outside
            served_model_name = http.pop("served_model_name")
            app = create_openai_app(client, tokenizer, served_model_name, None, **http)
            served[model["model_id"]] = ServedModel(app, tuple(model["lora_modules"]))
        return create_multi_model_app(served, self._api_key, **self._guards)
