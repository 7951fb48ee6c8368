"""OpenAIIngress: the OpenAI app in a deployment of its own, for `routing: prefix`.

    HTTP ─> Serve proxy ─> OpenAIIngress (create_openai_app over RoutedEngineClient)
                              │ validate, tokenize, chat template; SSE, usage, tool calls
                              ▼ handle.generate(token_ids, params, id, routing=RoutingKey)
                           PrefixAffinityRouter ─> LLMServer replica (RoutedLLMServer)
                              detokenize, stop strings (EngineFrontend) ─> SchedulerActor

One hop more than the default app (the OpenAI app inside LLMServer): the price of a
routing decision that sees the prompt (deployments/routing.py says why). The replica gets
token ids, so nothing is tokenized twice.

LoRA adapters are those of `lora_modules`, numbered as every replica's engine numbers them
(core/lora.startup_lora_ids), so the adapter's id in the RoutingKey keys its prefix chain
as the replica's block manager does. Runtime loading is not served here (AppArgs refuses
it under `routing: prefix`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from rayserve_paged.core.block_manager import prefix_block_keys
from rayserve_paged.core.lora import startup_lora_ids
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.deployments.access import replica_api_key
from rayserve_paged.deployments.fleet_metrics import METRICS_CACHE_S, FleetMetricsCache
from rayserve_paged.deployments.llm_server import load_tokenizer
from rayserve_paged.deployments.openai_ingress import ROUTING_SESSION, create_openai_app
from rayserve_paged.deployments.routing import ROUTING_STATS, RoutingKey
from rayserve_paged.engine.outputs import RequestOutput
from rayserve_paged.telemetry import merge_prometheus


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
    ) -> None:
        self._handle = handle
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

    async def model_info(self) -> dict:
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
        self._api_key = replica_api_key(self._http.pop("require_api_key", False))
        context = serve.get_replica_context()
        metrics = FleetMetricsCache(context.app_name, metrics_cache_s)
        self.client = RoutedEngineClient(llm_handle, block_size, metrics, context.replica_id.unique_id, lora_modules)
        self.tokenizer = load_tokenizer(tokenizer, trust_remote_code)

    def __serve_build_asgi_app__(self):
        http = dict(self._http)
        served_model_name = http.pop("served_model_name")
        return create_openai_app(self.client, self.tokenizer, served_model_name, self._api_key, **http)
