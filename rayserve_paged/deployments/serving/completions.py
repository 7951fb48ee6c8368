"""/v1/completions over the generation pipeline: one engine request per prompt, `echo`,
completions logprobs, and the streamed choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi.responses import Response
from pydantic import BaseModel, Field, field_validator

from rayserve_paged.deployments.admission import Admission
from rayserve_paged.deployments.errors import bad_request
from rayserve_paged.deployments.protocol import (
    MAX_CHOICES,
    MAX_PROMPTS,
    PROMPT_SCHEMAS,
    CompletionLogprobs,
    GenerationRequest,
    ResponseHead,
    UsageInfo,
    check_prompt_shape,
    documented,
)
from rayserve_paged.deployments.serving.logprobs import completion_logprobs
from rayserve_paged.deployments.serving.pipeline import ChoiceProgress, GenerationPipeline, Plan, Prompt, reasons_json
from rayserve_paged.deployments.sse import EventFrame, EventStreamResponse, json_response, json_value
from rayserve_paged.engine.outputs import CompletionOutput, RequestOutput


# --------------------------------------------------------------------------- request and response models


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description=(
            "A string, a list of strings (one set of n choices per prompt), a list of token ids, "
            f"or a list of token-id lists; at most {MAX_PROMPTS} prompts, none empty."
        ),
        json_schema_extra=lambda schema: schema.update(anyOf=PROMPT_SCHEMAS),
    )
    max_tokens: int | None = Field(
        16, description="Most tokens to generate per choice (>= 1).", **documented(minimum=1)
    )
    best_of: int | None = Field(
        None, ge=1, le=MAX_CHOICES, description="Generate best_of choices and return the n most likely (>= n)."
    )
    logprobs: int | None = Field(
        None, ge=0, description="Return the logprobs of the sampled tokens and of the most likely `logprobs` others."
    )
    echo: bool = Field(False, description="Put the prompt text in front of each choice's text.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, prompt):
        return check_prompt_shape(prompt)


class CompletionChoice(BaseModel):
    index: int = Field(description="prompt_index * n + choice_index.")
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop, length, or null while streaming.")
    stop_reason: int | str | None = Field(None, description="The stop string or stop token id that ended the choice.")


class CompletionResponse(ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseHead):
    """One server-sent event of a streamed completion."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --------------------------------------------------------------------------- the route


class CompletionServing:
    def __init__(self, pipeline: GenerationPipeline) -> None:
        self.pipeline = pipeline

    async def create_completion(self, request: CompletionRequest, admission: Admission | None = None) -> Response:
        plan = await self.prepare(request, admission)
        pipeline = self.pipeline
        if request.stream:
            first, outputs = await pipeline.open_stream(request, plan.prompts, plan.params, plan.request_ids)
            events = self._events(request, plan.prompts, first, outputs, plan.response_id)
            return EventStreamResponse(events, outputs)
        results = await pipeline.generate_body(request, plan.prompts, plan.params, plan.request_ids)
        return json_response(self.response(plan, results))

    async def prepare(self, request: CompletionRequest, admission: Admission | None = None) -> Plan:
        """Everything before the engine: the model, the sampling parameters, each prompt's
        token ids and its fit in the context."""
        pipeline = self.pipeline
        info, params = await pipeline.begin(request)
        if request.echo and request.logprobs is not None:
            raise bad_request("echo: cannot be combined with logprobs (prompt logprobs are not computed)")
        texts = _prompt_list(request.prompt)
        pipeline.reserve(admission, request, len(texts), params)
        prompts = await pipeline.in_pool(lambda: [self._prompt(p) for p in texts])
        for prompt in prompts:
            pipeline.check_fits(prompt.token_ids, params.max_tokens, info, "prompt", "max_tokens")
        return pipeline.plan(request, prompts, params, f"cmpl-{uuid.uuid4().hex}")

    def response(self, plan: Plan, results: list[RequestOutput]) -> CompletionResponse:
        """The non-streamed body of a prepared request, from its prompts' finished results."""
        request = plan.request
        choices = [
            self._choice(request, prompt, out, index * request.n + out.index)
            for index, (prompt, result) in enumerate(zip(plan.prompts, results))
            for out in result.outputs
        ]
        pipeline = self.pipeline
        return CompletionResponse(
            id=plan.response_id, model=pipeline.model_name(request), choices=choices,
            usage=pipeline.usage(plan.prompts, results),
        )  # fmt: skip

    def _prompt(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            return Prompt(prompt, self.pipeline.encode(prompt, "prompt"))
        return Prompt(None, list(prompt))

    def _echo_text(self, request: CompletionRequest, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.pipeline.tokenizer.decode(prompt.token_ids, skip_special_tokens=request.skip_special_tokens)

    def _choice(self, request: CompletionRequest, prompt: Prompt, out: CompletionOutput, index: int) -> CompletionChoice:
        text = self._echo_text(request, prompt) + out.text if request.echo else out.text
        logprobs = None
        if request.logprobs is not None and out.logprobs is not None:
            logprobs, _ = completion_logprobs(self.pipeline.token_texts, out.token_ids, out.logprobs, 0)
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason
        )

    def _events(
        self,
        request: CompletionRequest,
        prompts: list[Prompt],
        first: tuple[int, RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        response_id: str,
    ) -> AsyncIterator[str]:
        frame = EventFrame(response_id, "text_completion", int(time.time()), self.pipeline.model_name(request))

        def to_choice(index: int, out: CompletionOutput, state: ChoiceProgress) -> str:
            return self._delta(request, prompts[index], out, state, index * request.n + out.index)

        return self.pipeline.stream_events(request, prompts, first, outputs, to_choice, frame.event)

    def _delta(
        self, request: CompletionRequest, prompt: Prompt, out: CompletionOutput, state: ChoiceProgress, choice_index: int
    ) -> str:
        text = out.text
        if not state.is_started:
            state.is_started = True
            if request.echo:
                text = self._echo_text(request, prompt) + text
        logprobs = None
        if request.logprobs is not None and out.logprobs is not None and out.token_ids:
            logprobs, state.text_offset = completion_logprobs(
                self.pipeline.token_texts, out.token_ids, out.logprobs, state.text_offset
            )
        state.num_tokens += len(out.token_ids)
        if logprobs is not None:
            return CompletionChoice(
                index=choice_index,
                text=text,
                logprobs=logprobs,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            ).model_dump_json()
        return completion_choice_json(choice_index, text, out.finish_reason, out.stop_reason)


def completion_choice_json(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
    """A streamed CompletionChoice without logprobs, as pydantic writes it."""
    return f'{{"index":{index},"text":{json_value(text)},"logprobs":null,{reasons_json(finish_reason, stop_reason)}'


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)
