"""LLMServer: the Serve deployment of one engine (one replica = one SchedulerActor and its
tensor-parallel workers, all in the replica's placement group), and the HTTP app on it.

    HTTP (Serve proxy) ──> LLMServer replica: FastAPI app (openai_ingress.create_openai_app)
    DeploymentHandle   ──>   │ tokenize in a thread pool; EngineFrontend: detokenize, stop
                             ▼ strings, one buffer per request
                           SchedulerActor (step loop; one batch of deltas per step)

A token crosses one process boundary between the step loop and the HTTP response.

Python handle API:
    await handle.generate.remote(prompt_or_token_ids, sampling_params)        -> RequestOutput
    async for out in handle.options(stream=True).generate_stream.remote(...)   -> RequestOutputs

`generate` returns the cumulative result. `generate_stream` yields DELTAS: each output
carries only the text, token ids and logprobs that are new since the previous one (one
per engine step in which the request advanced, or several steps' worth for a slow reader);
the last has finished=True and the finish reasons. Join the pieces for the whole text.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import get_current_placement_group

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.sequence import SamplingParams, SamplingParamsError
from rayserve_paged.deployments.access import replica_api_keys
from rayserve_paged.deployments.autoscaling import EnginePressure, PressureReport
from rayserve_paged.deployments.fleet_metrics import (
    METRICS_CACHE_S,
    SCHEDULER_NAMESPACE,
    FleetMetricsCache,
    scheduler_actor_name,
)
from rayserve_paged.deployments.routing import ADAPTERS_STAT, OFFLOAD_KEYS_STAT, PREFIX_KEYS_STAT, RoutingKey
from rayserve_paged.deployments.tokenizer_pool import TokenizerPool
from rayserve_paged.engine.frontend import STREAM_BATCHING_INTERVAL_MS, EngineFrontend, EngineUnavailable
from rayserve_paged.engine.llm_engine import RequestError
from rayserve_paged.engine.outputs import RequestOutput
from rayserve_paged.engine.ray_executor import scheduler_actor_options, show_info_logs
from rayserve_paged.engine.scheduler_actor import SchedulerActor

logger = logging.getLogger(__name__)


def as_sampling_params(params: SamplingParams | dict | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        unknown = sorted(set(params) - set(SamplingParams.__dataclass_fields__))
        if unknown:
            raise SamplingParamsError(f"{unknown[0]}: unknown sampling parameter")
        return SamplingParams(**params)
    raise RequestError("sampling_params: expected SamplingParams or a dict of its fields")


class ReplicaSchedulerActor(SchedulerActor):
    """A replica's SchedulerActor, with the package's INFO lines in its log: at TP = 1 the
    model loads in this process, and the loader's load-time / peak-memory line is INFO."""

    def __init__(self, *args, **kwargs) -> None:
        show_info_logs()
        super().__init__(*args, **kwargs)


class ActorCore:
    """EngineCore over the SchedulerActor's handle. The actor's death (its process killed,
    or gone with its node) is EngineUnavailable: the caller answers 503 + Retry-After."""

    def __init__(self, actor) -> None:
        self.actor = actor

    async def add_request(self, request_id, prompt, prompt_token_ids, params, lora_name=None) -> None:
        try:
            await self.actor.add_request.remote(request_id, prompt, prompt_token_ids, params, lora_name)
        except RayActorError as e:
            raise EngineUnavailable(f"the engine process is gone: {e}") from None

    async def abort(self, request_id: str) -> None:
        try:
            await self.actor.abort.remote(request_id)
        except RayActorError:
            pass  # nothing is left to abort

    async def stop_sequences(self, request_id: str, stops: list[tuple[int, str]]) -> None:
        try:
            await self.actor.stop_sequences.remote(request_id, stops)
        except RayActorError:
            pass  # the output stream reports the engine's death

    async def outputs(self):
        try:
            async for ref in self.actor.outputs.options(num_returns="streaming").remote():
                yield await ref
        except RayActorError as e:
            raise EngineUnavailable(f"the engine process is gone: {e}") from None


class LLMServer:
    """One replica: the EngineClient (engine/protocol.py) its own OpenAI app and the handle
    API call, over an EngineFrontend and the replica's SchedulerActor."""

    serves_http = True  # the OpenAI app runs here (build_app's default, one hop)

    def __init__(
        self,
        engine_config: EngineConfig | dict,
        scheduler_cpus: float = 0.0,
        worker_cpus: float = 1.0,
        scheduler_actor=None,
        telemetry: dict | None = None,
        http: dict | None = None,
        tokenizer=None,
        stream_interval: int = 1,
        stream_batching_interval_ms: float = STREAM_BATCHING_INTERVAL_MS,
        metrics_cache_s: float = METRICS_CACHE_S,
    ) -> None:
        config = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig(**engine_config)
        self.config = config
        self._http = dict(http or {})
        # the key comes from this replica's environment, never from the app's arguments; a
        # missing key that is required stops the replica here, before anything starts
        require_api_key = self._http.pop("require_api_key", False)
        self._api_keys = replica_api_keys(require_api_key) if self.serves_http else {}
        self._app_name = None  # set when this replica's engine is findable by the fleet's /metrics
        if scheduler_actor is None:
            self._app_name = _app_name()
            placement = scheduler_actor_options(config, scheduler_cpus, worker_cpus, get_current_placement_group())
            scheduler_actor = (
                ray.remote(ReplicaSchedulerActor)
                .options(max_concurrency=10_000, **placement, **_fleet_name(self._app_name))
                .remote(config, worker_cpus=worker_cpus, telemetry={**(telemetry or {}), "replica": _replica_id()})
            )
        self.actor = scheduler_actor
        self._fleet_metrics = None if self._app_name is None else FleetMetricsCache(self._app_name, metrics_cache_s)
        self._pressure = PressureReport()
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
        self._info = ray.get(self.actor.model_info.remote())  # waits for the model to load
        self.frontend = EngineFrontend(
            ActorCore(self.actor), self.tokenizer, stream_interval, stream_batching_interval_ms
        )
        self.tokenizer_pool = TokenizerPool()  # the HTTP routes' and the handle API's
        # the engine's LoRA adapters, mirrored here (a request naming one needs no actor call);
        # runtime loads and unloads go through this replica, so the mirror follows them
        self._loras: dict[str, str] = dict(config.lora_modules)

    def __serve_build_asgi_app__(self):
        """Serve's late-bound ingress (`serve.ingress()(LLMServer)` in build_app): the
        OpenAI app over this replica's own front end."""
        from rayserve_paged.deployments.openai_ingress import create_openai_app

        http = dict(self._http)
        served_model_name = http.pop("served_model_name", None) or self.config.model
        return create_openai_app(
            self, self.tokenizer, served_model_name, self._api_keys, tokenizer_pool=self.tokenizer_pool, **http
        )

    # ------------------------------------------------------------------ handle API

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | dict | None = None,
        request_id: str | None = None,
        lora_name: str | None = None,
        routing: RoutingKey | None = None,
    ) -> RequestOutput:
        """The whole result, once finished (on the LoRA adapter `lora_name`, when given).
        `routing` is for the fleet's router (deployments/routing.py), which reads it before
        the call gets here."""
        params = as_sampling_params(sampling_params)
        text, token_ids = await self._prompt(prompt)
        return await self.frontend.generate(token_ids, params, request_id or _new_id(), text, lora_name)

    async def generate_stream(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | dict | None = None,
        request_id: str | None = None,
        lora_name: str | None = None,
        routing: RoutingKey | None = None,
    ):
        """Deltas (see the module docstring); closing the stream aborts the request.
        `routing`: as in `generate`."""
        params = as_sampling_params(sampling_params)
        text, token_ids = await self._prompt(prompt)
        stream = self.frontend.generate_stream(token_ids, params, request_id or _new_id(), text, lora_name=lora_name)
        async for out in stream:
            yield out

    async def lora_adapters(self) -> dict[str, str]:
        return dict(self._loras)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        lora = await self.actor.load_lora.remote(name, path)
        self._loras[name] = lora["lora_path"]

    async def unload_lora_adapter(self, name: str) -> bool:
        removed = await self.actor.unload_lora.remote(name)
        self._loras.pop(name, None)
        return removed

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, computed in the replica's tokenizer pool."""
        return await self.tokenizer_pool.run(
            lambda: list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        )

    async def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        text, token_ids = _split_prompt(prompt)
        if token_ids is None:
            token_ids = await self.tokenize(text)
        return text, token_ids

    async def abort(self, request_id: str) -> None:
        await self.frontend.abort(request_id)

    async def model_info(self) -> dict:
        if self.frontend.failure is not None:  # /health answers 503 once the engine is gone
            raise RuntimeError(f"the engine failed: {self.frontend.failure!r}")
        return dict(self._info)

    async def stats(self) -> dict:
        return await self.actor.stats.remote()

    async def metrics_text(self) -> str:
        """Prometheus text of every replica of this application, merged (GET /metrics), at
        most `metrics_cache_s` old; outside Serve (or with an injected engine), this
        replica's alone."""
        if self._fleet_metrics is None:
            return await self.actor.metrics_text.remote()
        return await self._fleet_metrics.text()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every few seconds when autoscaling is on; the KV-pressure policy
        (deployments/autoscaling.py) decides the replica count from these figures."""
        pressure = await self.actor.engine_pressure.remote()
        return self._pressure.stats(EnginePressure.from_dict(pressure, time.monotonic()))

    async def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (replaced)."""
        if self.frontend.failure is not None:
            raise RuntimeError(f"the engine failed: {self.frontend.failure!r}")
        await asyncio.wait_for(self.actor.check_health.remote(), timeout=20)


class RoutedLLMServer(LLMServer):
    """LLMServer under `routing: prefix`: it also reports the keys its prefix cache holds
    and the LoRA adapters in its device slots, which Serve's controller polls
    (request_routing_stats_period_s) and hands to the fleet's routers. Only this mode pays
    for the report. HTTP is served by OpenAIIngress (deployments/ingress.py), so this
    replica reads no API key."""

    serves_http = False

    async def record_routing_stats(self) -> dict[str, list[int]]:
        keys, adapters, offloaded = await asyncio.gather(
            self.actor.prefix_cache_keys.remote(),
            self.actor.resident_lora_ids.remote(),
            self.actor.offload_prefix_keys.remote(),
        )
        # frozensets: the routers take them over as they arrive, without building one per report
        return {PREFIX_KEYS_STAT: frozenset(keys), ADAPTERS_STAT: adapters, OFFLOAD_KEYS_STAT: frozenset(offloaded)}


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The tokenizer of a local directory, GGUF file or hub id (only its tokenizer files are
    fetched); built-in names ("smollm2", "tiny-opt", ...) resolve as in the engine."""
    from rayserve_paged.models.loader import load_tokenizer as load  # imports torch

    return load(name_or_path, trust_remote_code)


def _new_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def _app_name() -> str | None:
    """The Serve application of this replica; None outside a replica (tests, scripts)."""
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:
        return None


def _fleet_name(app_name: str | None) -> dict[str, str]:
    """Actor options that make the scheduler actor findable by the fleet's /metrics."""
    if app_name is None:
        return {}
    return {"name": scheduler_actor_name(app_name, _replica_id()), "namespace": SCHEDULER_NAMESPACE}


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # constructed outside a Serve replica (tests, scripts)
        return "0"


def _split_prompt(prompt) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt: empty prompt")
        return prompt, None
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise RequestError("prompt: empty prompt")
        return None, list(prompt)
    raise RequestError("prompt: expected a string or a list of token ids")
