"""The engine as its callers see it: one protocol for every client of a replica's engine.

    OpenAI routes (deployments/serving/) ──EngineClient──> LLMServer (the replica), or an
    DeploymentHandle callers                               EngineFrontend over an in-process
                                                           engine (tests)

Below it the front end talks to the step loop through `frontend.EngineCore` (the
SchedulerActor behind `llm_server.ActorCore`, or an in-process core in tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.outputs import RequestOutput


class EngineClient(Protocol):
    """What the routes need from an engine."""

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str
    ) -> RequestOutput:
        """The cumulative result."""
        ...

    def generate_stream(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Deltas: what is new since the previous output; the last is finished."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def model_info(self) -> dict:
        """{"model", "max_model_len", "vocab_size", "max_logprobs"}."""
        ...

    async def metrics_text(self) -> str:
        """Prometheus exposition text of the engine's metrics."""
        ...
