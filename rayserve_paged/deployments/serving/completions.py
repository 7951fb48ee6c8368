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
        16,
        description="Most tokens to generate per choice (>= 1); 0 with `echo`: only score the prompt (legacy API).",
        **documented(minimum=0),
    )
    best_of: int | None = Field(
        None, ge=1, le=MAX_CHOICES, description="Generate best_of choices and return the n most likely (>= n)."
    )
    logprobs: int | None = Field(
        None, ge=0, description="Return the logprobs of the sampled tokens and of the most likely `logprobs` others."
    )
    echo: bool = Field(
        False,
        description=(
            "Put the prompt text in front of each choice's text; with `logprobs`, the prompt's tokens lead the "
            "choice's logprobs too (the first token's logprob null)."
        ),
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        description=(
            "vLLM's field: each choice's `prompt_logprobs` lists, per prompt token (null for the first), its "
            "logprob and the `prompt_logprobs` most likely tokens', keyed by token id."
        ),
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, prompt):
        return check_prompt_shape(prompt)

    @property
    def is_prompt_only(self) -> bool:
        """max_tokens 0: one token is generated and dropped from the choice."""
        return self.max_tokens == 0

    @property
    def max_new_tokens(self) -> int | None:
        return 1 if self.is_prompt_only else self.max_tokens

    def requested_prompt_logprobs(self) -> tuple[int | None, str]:
        echoed = self.logprobs if self.echo else None
        if self.prompt_logprobs is None:
            return echoed, "logprobs"
        return max(self.prompt_logprobs, echoed or 0), "prompt_logprobs"


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int = Field(description="prompt_index * n + choice_index.")
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop, length, or null while streaming.")
    stop_reason: int | str | None = Field(None, description="The stop string or stop token id that ended the choice.")
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="With `prompt_logprobs` (vLLM's shape), on the first event of a stream."
    )


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
        if request.is_prompt_only and not request.echo:
            raise bad_request("max_tokens: 0 only with echo (it scores the prompt and generates nothing)")
        info, params = await pipeline.begin(request)
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
            self._choice(request, prompt, out, index * request.n + out.index, result.prompt_logprobs)
            for index, (prompt, result) in enumerate(zip(plan.prompts, results))
            for out in result.outputs
        ]
        pipeline = self.pipeline
        usage = pipeline.usage(plan.prompts, results)
        if request.is_prompt_only:
            usage = usage.model_copy(update={"completion_tokens": 0, "total_tokens": usage.prompt_tokens})
        return CompletionResponse(
            id=plan.response_id, model=pipeline.model_name(request), choices=choices, usage=usage
        )  # fmt: skip

    def _prompt(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            return Prompt(prompt, self.pipeline.encode(prompt, "prompt"))
        return Prompt(None, list(prompt))

    def _echo_text(self, request: CompletionRequest, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.pipeline.tokenizer.decode(prompt.token_ids, skip_special_tokens=request.skip_special_tokens)

    def _choice(
        self, request: CompletionRequest, prompt: Prompt, out: CompletionOutput, index: int,
        scores: list[dict[int, float] | None] | None,
    ) -> CompletionChoice:  # fmt: skip
        text, token_ids, token_logprobs = _visible(request, out)
        text = self._echo_text(request, prompt) + text if request.echo else text
        logprobs, offset = None, 0
        if request.logprobs is not None and request.echo and scores is not None:
            logprobs, offset = self._echoed_logprobs(prompt, scores)
        if request.logprobs is not None and token_logprobs is not None and token_ids:
            generated, _ = completion_logprobs(self.pipeline.token_texts, token_ids, token_logprobs, offset)
            logprobs = generated if logprobs is None else _joined(logprobs, generated)
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason,
            prompt_logprobs=self._prompt_logprobs(request, prompt, scores),
        )  # fmt: skip

    def _echoed_logprobs(self, prompt: Prompt, scores: list[dict[int, float] | None]) -> tuple[CompletionLogprobs, int]:
        """The prompt tokens' part of an echoed choice's logprobs (the first token's null),
        and the text offset after them."""
        texts = self.pipeline.token_texts
        first = texts.text(prompt.token_ids[0])
        head = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
        rest, offset = completion_logprobs(texts, prompt.token_ids[1:], scores[1:], len(first))
        return _joined(head, rest), offset

    def _prompt_logprobs(
        self, request: CompletionRequest, prompt: Prompt, scores: list[dict[int, float] | None] | None
    ) -> list[dict[str, PromptLogprob] | None] | None:
        if request.prompt_logprobs is None or scores is None:
            return None
        text = self.pipeline.token_texts.text
        return [None] + [
            {str(t): PromptLogprob(logprob=lp, decoded_token=text(t)) for t, lp in top.items()} for top in scores[1:]
        ]

    def _events(
        self,
        request: CompletionRequest,
        prompts: list[Prompt],
        first: tuple[int, RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        response_id: str,
    ) -> AsyncIterator[str]:
        frame = EventFrame(response_id, "text_completion", int(time.time()), self.pipeline.model_name(request))

        scores: dict[int, list] = {}  # prompt index -> its prompt logprobs (with its first output)

        def noted(item: tuple[int, RequestOutput]) -> tuple[int, RequestOutput]:
            if item[1].prompt_logprobs is not None:
                scores.setdefault(item[0], item[1].prompt_logprobs)
            return item

        async def noting() -> AsyncIterator[tuple[int, RequestOutput]]:
            async for item in outputs:
                yield noted(item)

        def to_choice(index: int, out: CompletionOutput, state: ChoiceProgress) -> str:
            return self._delta(request, prompts[index], out, state, index * request.n + out.index, scores.get(index))

        stream = noting() if request.prompt_logprobs is not None or request.echo else outputs
        return self.pipeline.stream_events(request, prompts, noted(first), stream, to_choice, frame.event)

    def _delta(
        self, request: CompletionRequest, prompt: Prompt, out: CompletionOutput, state: ChoiceProgress, choice_index: int,
        scores: list[dict[int, float] | None] | None = None,
    ) -> str:  # fmt: skip
        text, token_ids, token_logprobs = _visible(request, out)
        logprobs = prompt_logprobs = None
        if not state.is_started:
            state.is_started = True
            if request.echo:
                text = self._echo_text(request, prompt) + text
            if request.logprobs is not None and request.echo and scores is not None:
                logprobs, state.text_offset = self._echoed_logprobs(prompt, scores)
            prompt_logprobs = self._prompt_logprobs(request, prompt, scores)
        if request.logprobs is not None and token_logprobs is not None and token_ids:
            generated, state.text_offset = completion_logprobs(
                self.pipeline.token_texts, token_ids, token_logprobs, state.text_offset
            )
            logprobs = generated if logprobs is None else _joined(logprobs, generated)
        state.num_tokens += len(token_ids)
        if logprobs is not None or prompt_logprobs is not None:
            return CompletionChoice(
                index=choice_index,
                text=text,
                logprobs=logprobs,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                prompt_logprobs=prompt_logprobs,
            ).model_dump_json()
        return completion_choice_json(choice_index, text, out.finish_reason, out.stop_reason)


def completion_choice_json(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
    """A streamed CompletionChoice without logprobs, as pydantic writes it."""
    reasons = reasons_json(finish_reason, stop_reason)[:-1]  # the choice's last field is prompt_logprobs
    return f'{{"index":{index},"text":{json_value(text)},"logprobs":null,{reasons},"prompt_logprobs":null}}'


def _visible(request: CompletionRequest, out: CompletionOutput) -> tuple[str, list[int], list | None]:
    """The choice's own text, token ids and logprobs (none for max_tokens 0)."""
    if request.is_prompt_only:
        return "", [], None
    return out.text, out.token_ids, out.logprobs


def _joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)
