"""OpenAIIngress: the OpenAI app in a deployment of its own, for `routing: prefix`.

    HTTP ─> Serve proxy ─> OpenAIIngress (create_openai_app over RoutedEngineClient)
                              │ validate, tokenize, chat template; SSE, usage, tool calls
                              ▼ handle.generate(token_ids, params, id, routing=RoutingKey)
                           PrefixAffinityRouter ─> LLMServer replica (RoutedLLMServer)
                              detokenize, stop strings (EngineFrontend) ─> SchedulerActor

One hop more than the default app (the OpenAI app inside LLMServer): the price of a
routing decision that sees the prompt (deployments/routing.py says why). The replica gets
token ids, so nothing is tokenized twice.

While no LLMServer replica is RUNNING and one is STARTING (the fleet's first start, or all
replicas replaced at once), a request is answered 503 + Retry-After (`engine_starting`) at
once (FleetReadiness), where Serve's router would hold it until a replica runs: the replica
is RUNNING only once its model is loaded, so serve.run, `serve status` and KubeRay read it
as ready only then.

LoRA adapters are those of `lora_modules`, numbered as every replica's engine numbers them
(core/lora.startup_lora_ids), so the adapter's id in the RoutingKey keys its prefix chain
as the replica's block manager does. Runtime loading is not served here (AppArgs refuses
it under `routing: prefix`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from rayserve_paged.core.block_manager import prefix_block_keys
from rayserve_paged.core.lora import startup_lora_ids
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.deployments.access import replica_api_keys
from rayserve_paged.deployments.errors import engine_starting
from rayserve_paged.deployments.fleet_metrics import METRICS_CACHE_S, CachedFetch, FleetMetricsCache
from rayserve_paged.deployments.llm_server import load_tokenizer
from rayserve_paged.deployments.openai_ingress import ROUTING_SESSION, create_openai_app
from rayserve_paged.deployments.routing import ROUTABLE_REPLICAS, ROUTING_STATS, RoutingKey
from rayserve_paged.engine.outputs import RequestOutput
from rayserve_paged.telemetry import merge_prometheus

logger = logging.getLogger(__name__)

STATUS_CACHE_S = 1.0  # how long the controller's replica counts are trusted while no replica is routable
STATUS_TIMEOUT_S = 5.0


def is_starting(replica_states: Mapping[str, int] | None) -> bool:
    """No replica RUNNING and at least one STARTING (being placed, or in its constructor:
    loading its model). None (the controller could not say) is not starting."""
    return bool(replica_states) and not replica_states.get("RUNNING") and replica_states.get("STARTING", 0) > 0


async def fetch_replica_states(app_name: str, deployment_name: str) -> dict[str, int] | None:
    """The controller's count of the deployment's replicas by state (serve.status(), a
    blocking call: in a thread); None when it cannot be had."""
    from ray import serve

    try:
        status = await asyncio.wait_for(asyncio.to_thread(serve.status), STATUS_TIMEOUT_S)
    except Exception as e:
        logger.warning("serve status unavailable: %s: %s", type(e).__name__, e)
        return None
    app = status.applications.get(app_name)
    deployment = app.deployments.get(deployment_name) if app is not None else None
    if deployment is None:
        return None
    return {getattr(state, "value", state): n for state, n in deployment.replica_states.items()}


class FleetReadiness:
    """Whether LLMServer can take a request, or none can yet while one starts: then
    `check` raises engine_starting (503 + Retry-After), where Serve's router would hold
    the request, with no deadline of its own, until a replica is RUNNING.

    Free on the request path while replicas run: the fleet routers' own replica sets
    (ROUTABLE_REPLICAS, no remote call). Only when they hold none, the controller's replica
    counts, fetched at most once per `ttl_s` and shared. A fleet scaled to zero (none
    RUNNING, none STARTING) is not starting: its request goes on to the handle, whose
    queued request makes Serve's autoscaler start a replica."""

    def __init__(
        self,
        app_name: str,
        deployment_name: str,
        ttl_s: float = STATUS_CACHE_S,
        fetch_states: Callable[[str, str], Awaitable[Mapping[str, int] | None]] = fetch_replica_states,
        num_routable: Callable[[str], int] = ROUTABLE_REPLICAS.num_routable,
    ) -> None:
        self.app_name = app_name
        self._num_routable = num_routable
        self._states = CachedFetch(lambda: fetch_states(app_name, deployment_name), ttl_s)

    async def check(self) -> None:
        if self._num_routable(self.app_name) > 0:
            return
        if is_starting(await self._states.get()):
            raise engine_starting("the server is starting: no replica has loaded its model yet; retry later")


class RoutedEngineClient:
    """EngineClient over a DeploymentHandle to LLMServer; each generation carries the
    RoutingKey of its prompt and session. An abort cancels the call in flight (Serve
    cancels it on the replica, whose front end aborts the engine request), so it reaches
    the replica that holds the request."""

    def __init__(
        self,
        handle,
        block_size: int,
        metrics: FleetMetricsCache | None,
        ingress_id: str,
        lora_modules: dict[str, str] | None = None,
        readiness: FleetReadiness | None = None,
    ) -> None:
        self._handle = handle
        self._readiness = readiness
        self._stream_handle = handle.options(stream=True)
        self.block_size = block_size
        self._metrics = metrics
        self._ingress_id = ingress_id
        self._in_flight: dict[str, object] = {}  # request id -> its DeploymentResponse(Generator)
        self._loras = dict(lora_modules or {})  # name -> directory, as every replica registers them
        self._lora_ids = startup_lora_ids(self._loras)

    def routing_key(self, token_ids: list[int], params: SamplingParams, lora_name: str | None = None) -> RoutingKey:
        adapter = 0 if lora_name is None else self._lora_ids[lora_name]  # the pipeline checked the name
        keys = prefix_block_keys(token_ids, self.block_size, params.cache_salt, lora_id=adapter)
        return RoutingKey(tuple(keys), ROUTING_SESSION.get(), adapter)

    async def lora_adapters(self) -> dict[str, str]:
        return dict(self._loras)

    async def generate(
        self, prompt: list[int], sampling_params: SamplingParams, request_id: str, lora_name: str | None = None
    ) -> RequestOutput:
        await self.check_ready()
        key = self.routing_key(prompt, sampling_params, lora_name)
        response = self._handle.generate.remote(prompt, sampling_params, request_id, lora_name=lora_name, routing=key)
        self._in_flight[request_id] = response
        try:
            return await response
        finally:
            self._in_flight.pop(request_id, None)

    async def generate_stream(
        self, prompt: list[int], sampling_params: SamplingParams, request_id: str, lora_name: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        await self.check_ready()
        key = self.routing_key(prompt, sampling_params, lora_name)
        response = self._stream_handle.generate_stream.remote(
            prompt, sampling_params, request_id, lora_name=lora_name, routing=key
        )
        self._in_flight[request_id] = response
        is_finished = False
        try:
            async for output in response:
                is_finished = output.finished
                yield output
        finally:
            self._in_flight.pop(request_id, None)
            if not is_finished:
                response.cancel()

    async def abort(self, request_id: str) -> None:
        response = self._in_flight.pop(request_id, None)
        if response is not None:
            response.cancel()

    async def check_ready(self) -> None:
        """engine_starting (503 + Retry-After) while no replica can take a call and one starts."""
        if self._readiness is not None:
            await self._readiness.check()

    async def model_info(self) -> dict:
        await self.check_ready()
        return await self._handle.model_info.remote()

    async def metrics_text(self) -> str:
        """The fleet's merged engine metrics and this ingress's routing decisions."""
        fleet = await (self._metrics.text() if self._metrics else self._handle.metrics_text.remote())
        return merge_prometheus([fleet, ROUTING_STATS.metrics_text(self._ingress_id)])


class OpenAIIngress:
    """The HTTP deployment of `routing: prefix` (build_app makes it a Serve ingress)."""

    def __init__(
        self,
        llm_handle,
        tokenizer: str,
        block_size: int,
        http: dict,
        trust_remote_code: bool = False,
        metrics_cache_s: float = METRICS_CACHE_S,
        lora_modules: dict[str, str] | None = None,
    ) -> None:
        from ray import serve

        self._http = dict(http)
        self._api_keys = replica_api_keys(self._http.pop("require_api_key", False))
        context = serve.get_replica_context()
        metrics = FleetMetricsCache(context.app_name, metrics_cache_s)
        readiness = FleetReadiness(context.app_name, llm_handle.deployment_name)
        self.client = RoutedEngineClient(
            llm_handle, block_size, metrics, context.replica_id.unique_id, lora_modules, readiness
        )
        self.tokenizer = load_tokenizer(tokenizer, trust_remote_code)

    def __serve_build_asgi_app__(self):
        http = dict(self._http)
        served_model_name = http.pop("served_model_name")
        return create_openai_app(self.client, self.tokenizer, served_model_name, self._api_keys, **http)
