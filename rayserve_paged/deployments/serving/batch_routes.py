"""The OpenAI routes without HTTP, for batch jobs: what `rayserve_paged.batch` runs through
its `BatchRoutes` protocol (batch imports nothing of deployments/; the caller, e.g. the
`rayserve-paged batch` command, hands this class in).

    batch line's body ──prepare──> Plan (checked, rendered, tokenized: a CPU task)
                                     │  token ids, SamplingParams, LoRA name
                                     ▼
                              the batch job's engine actors (engine/ only)
                                     │  RequestOutputs
                                     ▼
    the server's body  <──respond── Plan + results (a CPU task)     error: the server's error body

`prepare` and `respond` are the two halves of the routes' own non-streamed path
(ChatServing / CompletionServing), so a line's body is the one the server answers for it,
byte for byte but for `id` and `created`.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from rayserve_paged.deployments.errors import bad_request, to_openai_error, validation_error
from rayserve_paged.deployments.protocol import ErrorResponse, engine_renames
from rayserve_paged.deployments.serving.chat import ChatCompletionRequest, ChatServing
from rayserve_paged.deployments.serving.completions import CompletionRequest, CompletionServing
from rayserve_paged.deployments.serving.pipeline import GenerationPipeline, Plan
from rayserve_paged.engine.outputs import RequestOutput

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


class _ModelOnlyClient:
    """The EngineClient a route's `prepare` asks: the model's limits and the adapters the
    batch job's engines register at start-up. It runs nothing (the engine actors do)."""

    def __init__(self, info: dict, lora_modules: dict[str, str]) -> None:
        self.info = dict(info)
        self.loras = dict(lora_modules)

    async def model_info(self) -> dict:
        return dict(self.info)

    async def lora_adapters(self) -> dict[str, str]:
        return dict(self.loras)


class OpenAIBatchRoutes:
    """/v1/chat/completions and /v1/completions bodies, split at the engine."""

    urls = (CHAT_URL, COMPLETIONS_URL)

    def __init__(
        self,
        tokenizer,
        info: dict,
        served_model_name: str,
        lora_modules: dict[str, str] | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        pipeline = GenerationPipeline(_ModelOnlyClient(info, lora_modules or {}), tokenizer, served_model_name)
        chat, completions = ChatServing(pipeline, tool_call_parser), CompletionServing(pipeline)
        self._by_url = {CHAT_URL: (ChatCompletionRequest, chat), COMPLETIONS_URL: (CompletionRequest, completions)}
        self._by_request = {ChatCompletionRequest: chat, CompletionRequest: completions}

    async def prepare(self, url: str, body: dict) -> Plan:
        """The body checked as the server checks it (OpenAIError: the answer is an error)."""
        model, route = self._by_url[url]
        try:
            request = model.model_validate(body)
        except ValidationError as exc:
            raise validation_error(RequestValidationError(exc.errors(include_url=False))) from None
        if request.stream:
            raise bad_request("stream: a batch line is answered whole; leave stream out (or false)", param="stream")
        return await route.prepare(request)

    def respond(self, plan: Plan, results: list[RequestOutput]) -> str:
        """The 200 body's JSON, as the server writes it."""
        return self._by_request[type(plan.request)].response(plan, results).model_dump_json()

    @staticmethod
    def error(exc: BaseException, plan: Plan | None = None) -> tuple[int, str]:
        """(status code, the server's error body JSON) for a failure at any stage; with the
        line's plan, an engine error names the request field the client wrote."""
        renames = engine_renames(plan.request) if plan is not None else None
        error = to_openai_error(exc, renames) if isinstance(exc, Exception) else to_openai_error(RuntimeError(exc))
        return error.status_code, ErrorResponse(error=error.info).model_dump_json()
