"""What a batch job needs of the OpenAI routes, as a protocol: batch/ imports nothing of
deployments/ (DESIGN.md section 3), so whoever starts a job hands in the class that speaks
the server's API (`rayserve_paged.deployments.serving.batch_routes.OpenAIBatchRoutes`; the
`rayserve-paged batch` command does). The class is sent to the CPU stages by reference
and built there, once per stage actor, with that actor's tokenizer.

    prepare(url, body) -> plan      CPU stage: the server's checks, chat template, token ids
    plan.prompts / .params / ...    engine stage: what it runs (engine types only)
    respond(plan, results) -> JSON  CPU stage: the body the server answers
    error(exc, plan) -> (status, JSON)   the server's error body, for any stage's failure
"""

from __future__ import annotations

from typing import Protocol

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.outputs import RequestOutput


class EnginePrompt(Protocol):
    token_ids: list[int]


class EnginePlan(Protocol):
    """A prepared line as the engine stage reads it; the rest is the routes' own."""

    prompts: list[EnginePrompt]  # one engine request each
    params: SamplingParams
    request_ids: list[str]  # unique per engine request
    lora_name: str | None


class BatchRoutes(Protocol):
    urls: tuple[str, ...]  # the `url`s a batch line may name

    def __init__(
        self, tokenizer, info: dict, served_model_name: str, lora_modules: dict[str, str],
        tool_call_parser: str | None,
    ) -> None: ...  # fmt: skip

    async def prepare(self, url: str, body: dict) -> EnginePlan:
        """Raises when the line is answered with an error (see `error`)."""
        ...

    def respond(self, plan: EnginePlan, results: list[RequestOutput]) -> str:
        """The 200 body's JSON text, one result per prompt."""
        ...

    @staticmethod
    def error(exc: BaseException, plan: EnginePlan | None = None) -> tuple[int, str]:
        """(status code, error body JSON text)."""
        ...
