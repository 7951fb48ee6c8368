"""LLMServer: the Serve deployment of one engine (one replica = one SchedulerActor and its
tensor-parallel workers, all in the replica's placement group).

Python handle API:
    await handle.generate.remote(prompt_or_token_ids, sampling_params)        -> RequestOutput
    async for out in handle.options(stream=True).generate_stream.remote(...)   -> RequestOutputs

Streamed outputs are cumulative (the full text and token ids so far), one per engine step in
which the request advanced; the last has finished=True.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.sequence import SamplingParams, SamplingParamsError
from rayserve_paged.deployments.autoscaling import EnginePressure, PressureReport
from rayserve_paged.deployments.fleet_metrics import SCHEDULER_NAMESPACE, fleet_metrics_text, scheduler_actor_name
from rayserve_paged.engine.llm_engine import RequestError
from rayserve_paged.engine.outputs import RequestOutput
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


class LLMServer:
    def __init__(
        self,
        engine_config: EngineConfig | dict,
        scheduler_cpus: float = 0.0,
        worker_cpus: float = 1.0,
        scheduler_actor=None,
        telemetry: dict | None = None,
    ) -> None:
        config = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig(**engine_config)
        self.config = config
        self._app_name = None  # set when this replica's engine is findable by the fleet's /metrics
        if scheduler_actor is None:
            self._app_name = _app_name()
            pg = get_current_placement_group()
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0) if pg else None
            scheduler_actor = (
                ray.remote(SchedulerActor)
                .options(
                    num_cpus=scheduler_cpus,
                    max_concurrency=10_000,
                    scheduling_strategy=strategy,
                    **_fleet_name(self._app_name),
                )
                .remote(config, worker_cpus=worker_cpus, telemetry={**(telemetry or {}), "replica": _replica_id()})
            )
        self.actor = scheduler_actor
        self._pressure = PressureReport()
        self._info = ray.get(self.actor.model_info.remote())  # waits for the model to load
        self._queues: dict[str, asyncio.Queue] = {}
        self._pump: asyncio.Task | None = None
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ handle API

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams | dict | None = None, request_id: str | None = None
    ) -> RequestOutput:
        last = None
        async for last in self.generate_stream(prompt, sampling_params, request_id):
            pass
        return last

    async def generate_stream(
        self, prompt: str | list[int], sampling_params: SamplingParams | dict | None = None, request_id: str | None = None
    ):
        params = as_sampling_params(sampling_params)
        text, token_ids = _split_prompt(prompt)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        self._start_pump()
        if self._failure is not None:
            raise RuntimeError(f"the engine is unavailable: {self._failure!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self.actor.add_request.remote(request_id, text, token_ids, params)
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if out.error is not None:
                    raise RequestError(f"prompt: {out.error}")
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the caller went away (or failed): free the request's blocks now
                self._detached(self._send_abort(request_id))

    async def _send_abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)

    async def model_info(self) -> dict:
        if self._failure is not None:  # /health answers 503 once the engine is gone
            raise RuntimeError(f"the engine failed: {self._failure!r}")
        return dict(self._info)

    async def stats(self) -> dict:
        return await self.actor.stats.remote()

    async def metrics_text(self) -> str:
        return await self.actor.metrics_text.remote()

    async def fleet_metrics_text(self) -> str:
        """Prometheus text of every replica of this application, merged (GET /metrics);
        outside Serve (or with an injected engine), this replica's alone."""
        if self._app_name is None:
            return await self.metrics_text()
        return await fleet_metrics_text(self._app_name)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every few seconds when autoscaling is on; the KV-pressure policy
        (deployments/autoscaling.py) decides the replica count from these figures."""
        pressure = await self.actor.engine_pressure.remote()
        return self._pressure.stats(EnginePressure.from_dict(pressure, time.monotonic()))

    async def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (replaced)."""
        if self._failure is not None:
            raise RuntimeError(f"the engine failed: {self._failure!r}")
        await asyncio.wait_for(self.actor.check_health.remote(), timeout=20)

    # ------------------------------------------------------------------ output pump

    @staticmethod
    def _detached(coro) -> asyncio.Task:
        """Run `coro` outside the calling request's context. Serve cancels the Ray calls a
        request made when the request is cancelled (a client disconnect); the shared output
        stream and the abort of a cancelled request must outlive it."""
        return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())

    def _start_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = self._detached(self._pump_outputs())

    async def _pump_outputs(self) -> None:
        """One stream from the scheduler actor carries every request's output, per step."""
        try:
            async for ref in self.actor.outputs.options(num_returns="streaming").remote():
                for out in await ref:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as e:  # the actor or a worker died: fail everyone waiting, at once
            logger.error("engine output stream failed: %r", e)
            self._failure = e
            for queue in self._queues.values():
                queue.put_nowait(RuntimeError(f"the engine failed: {e!r}"))


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
