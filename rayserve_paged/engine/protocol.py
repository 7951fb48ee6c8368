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
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str, lora_name: str | None = None
    ) -> RequestOutput:
        """The cumulative result (`lora_name`: a registered LoRA adapter; None: the base model)."""
        ...

    def generate_stream(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str, lora_name: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Deltas: what is new since the previous output; the last is finished."""
        ...

    async def lora_adapters(self) -> dict[str, str]:
        """The registered LoRA adapters: name -> PEFT directory."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Register an adapter (raises the engine's error: already loaded, LoRAError)."""
        ...

    async def unload_lora_adapter(self, name: str) -> bool:
        """Forget an adapter; False when no adapter has that name."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def model_info(self) -> dict:
        """{"model", "max_model_len", "vocab_size", "max_logprobs"}."""
        ...

    async def metrics_text(self) -> str:
        """Prometheus exposition text of the engine's metrics."""
        ...
