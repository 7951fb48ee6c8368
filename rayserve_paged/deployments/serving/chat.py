"""/v1/chat/completions over the generation pipeline: the chat template, tool calls
(forced by tool_choice, or read by the deployment's parser), chat logprobs and the
streamed chunks."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, Field, field_validator, model_serializer, model_validator

from rayserve_paged.core.sequence import SamplingParams, SamplingParamsError, StructuredOutputsParams
from rayserve_paged.deployments.admission import Admission
from rayserve_paged.deployments.errors import bad_request
from rayserve_paged.deployments.protocol import (
    MAX_CHOICES,
    MAX_TOP_LOGPROBS,
    ChatLogprobs,
    GenerationRequest,
    RequestModel,
    ResponseHead,
    UsageInfo,
    check_unicode,
    check_unicode_within,
    documented,
)
from rayserve_paged.deployments.serving.logprobs import chat_logprobs
from rayserve_paged.deployments.serving.pipeline import ChoiceProgress, GenerationPipeline, Plan, Prompt, reasons_json
from rayserve_paged.deployments.sse import EventFrame, EventStreamResponse, json_response, json_value
from rayserve_paged.engine.outputs import CompletionOutput, RequestOutput
from rayserve_paged.engine.tool_calls import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallStream,
    ToolChoiceError,
    forced_calls,
    forced_schema,
    named_function,
    parse_tool_calls,
)


# --------------------------------------------------------------------------- request and response models


class ContentPart(RequestModel):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")

    @field_validator("text")
    @classmethod
    def _check_text(cls, text: str) -> str:
        return check_unicode(text)


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="Who speaks; developer is treated as system; tool carries a tool's result."
    )
    content: str | list[ContentPart] | None = Field(
        None, description="The message text, or a list of text parts; may be null for an assistant's tool calls."
    )
    name: str | None = Field(None, description="Participant name (passed to the chat template).")
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="An assistant's tool calls (passed to the chat template as sent)."
    )
    tool_call_id: str | None = Field(None, description="The call a tool message answers (passed to the template).")

    @field_validator("content", "name", "tool_call_id", "tool_calls")
    @classmethod
    def _check_text(cls, value):
        return check_unicode_within(value)

    @model_validator(mode="after")
    def _content_unless_tool_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (only an assistant message with tool_calls may leave it out)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's dict shape)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_tokens: int | None = Field(
        None, description="Deprecated alias of max_completion_tokens.", **documented(minimum=1)
    )
    max_completion_tokens: int | None = Field(
        None,
        description="Most tokens to generate per choice; omitted = up to the model's context length.",
        **documented(minimum=1),
    )
    best_of: int | None = Field(
        None, ge=1, le=MAX_CHOICES, description="Generate best_of choices and return the n most likely (>= n)."
    )
    logprobs: bool = Field(False, description="Return the logprob of each generated token.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: also this many most likely tokens per position."
    )
    tools: list[dict[str, Any]] | None = Field(
        None,
        description="Tool definitions ({'type': 'function', 'function': {name, description, parameters}}), "
        "passed to the chat template.",
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="'none' (no tools), 'auto' (the server's tool_call_parser reads calls from the output), "
        "'required' (the output is one or more calls) or {'type': 'function', 'function': {'name': ...}}.",
    )
    parallel_tool_calls: bool = Field(True, description="With tool_choice 'required': allow more than one call.")

    @field_validator("tools", "tool_choice")
    @classmethod
    def _check_tools(cls, value):
        return check_unicode_within(value)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> tuple[int | None, str]:
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs: needs logprobs: true")
        if not self.logprobs:
            return None, "top_logprobs"
        return self.top_logprobs or 0, "top_logprobs"

    def sampling_field_names(self) -> dict[str, str]:
        return {"max_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"}

    def prompt_field_renames(self) -> dict[str, str]:
        return {"prompt_token_ids": "messages", "prompt": "messages", "logprobs": "top_logprobs"}

    def implied_constraint_field(self) -> str:
        return "tools" if self.tool_choice not in (None, "none", "auto") else ""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="The calls the model made: [{id, type: 'function', function: {name, arguments}}]."
    )

    @model_serializer(mode="wrap")
    def _no_absent_tool_calls(self, handler):
        body = handler(self)
        if body.get("tool_calls") is None:
            body.pop("tool_calls", None)
        return body


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A chat stream's increment; fields it does not carry are left out, not null."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's chunks: [{index, id, type, function}]

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseHead):
    """One server-sent event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# --------------------------------------------------------------------------- the route


class ChatServing:
    def __init__(self, pipeline: GenerationPipeline, tool_call_parser: str | None = None) -> None:
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: expected one of {', '.join(TOOL_CALL_PARSERS)} (got {tool_call_parser!r})")
        self.pipeline = pipeline
        self.tool_call_parser = tool_call_parser  # reads tool calls out of tool_choice "auto" outputs

    async def create_chat_completion(
        self, request: ChatCompletionRequest, admission: Admission | None = None
    ) -> Response:
        plan = await self.prepare(request, admission)
        pipeline = self.pipeline
        if request.stream:
            first, outputs = await pipeline.open_stream(request, plan.prompts, plan.params, plan.request_ids)
            events = self._events(request, plan.prompts[0], first, outputs, plan.response_id, plan.tools)
            return EventStreamResponse(events, outputs)
        results = await pipeline.generate_body(request, plan.prompts, plan.params, plan.request_ids)
        return json_response(self.response(plan, results))

    async def prepare(self, request: ChatCompletionRequest, admission: Admission | None = None) -> Plan:
        """Everything before the engine: the model, the sampling parameters (with forced tool
        calls), the conversation through the chat template, and its fit in the context."""
        pipeline = self.pipeline
        info, params = await pipeline.begin(request)
        params = _with_forced_tool_calls(request, params)
        pipeline.reserve(admission, request, 1, params)
        tools = self._tool_mode(request)
        prompt = await pipeline.in_pool(lambda: self.render(request))
        max_tokens_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        pipeline.check_fits(prompt.token_ids, params.max_tokens, info, "messages", max_tokens_field)
        return pipeline.plan(request, [prompt], params, f"chatcmpl-{uuid.uuid4().hex}", tools)

    def response(self, plan: Plan, results: list[RequestOutput]) -> ChatCompletionResponse:
        """The non-streamed body of a prepared request, from its finished result."""
        request, (result,) = plan.request, results
        choices = []
        for out in result.outputs:
            content, calls = self._tool_calls(request, plan.tools, out.text, out.finish_reason)
            choices.append(
                ChatChoice(
                    index=out.index,
                    message=AssistantMessage(content=content, tool_calls=[c.as_openai() for c in calls] or None),
                    logprobs=self._logprobs(request, out.token_ids, out.logprobs),
                    finish_reason="tool_calls" if calls else out.finish_reason,
                    stop_reason=out.stop_reason,
                )
            )
        pipeline = self.pipeline
        return ChatCompletionResponse(
            id=plan.response_id, model=pipeline.model_name(request), choices=choices,
            usage=pipeline.usage(plan.prompts, results),
        )  # fmt: skip

    def render(self, request: ChatCompletionRequest, add_generation_prompt: bool = True) -> Prompt:
        """The conversation through the model's chat template, and its token ids."""
        tokenizer = self.pipeline.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise bad_request(
                f"messages: the model {self.pipeline.served_model_name!r} has no chat template; use /v1/completions",
                param="messages",
            )
        messages = [m.for_template() for m in request.messages]
        options = {}
        if request.tools and request.tool_choice != "none":
            options["tools"] = request.tools
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **options
            )
        except Exception as exc:  # the template's own checks (e.g. role order) raise
            raise bad_request(f"messages: the chat template rejected the conversation: {exc}", param="messages")
        # the template renders the BOS itself: no special tokens added on top
        return Prompt(text, self.pipeline.encode(text, "messages", add_special_tokens=False))

    def _tool_mode(self, request: ChatCompletionRequest) -> str | None:
        """How this request's tool calls are read: "forced" (required / named: the output
        is constrained to calls), "auto" (the deployment's parser reads them), or None."""
        if not request.tools or request.tool_choice == "none":
            return None
        if request.tool_choice not in (None, "auto"):
            return "forced"
        return "auto" if self.tool_call_parser is not None else None

    def _tool_calls(
        self, request: ChatCompletionRequest, mode: str | None, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished choice. A forced call cut short (length,
        abort) is not a call: its text stays content."""
        if mode == "forced" and finish_reason == "stop":
            calls = forced_calls(text, request.tool_choice)
            return (None, calls) if calls else (text, [])
        if mode == "auto":
            return parse_tool_calls(self.tool_call_parser, text)
        return text, []

    def _logprobs(
        self, request: ChatCompletionRequest, token_ids: list[int], logprobs: list[dict[int, float]] | None
    ) -> ChatLogprobs | None:
        if not request.logprobs or logprobs is None:
            return None
        return chat_logprobs(self.pipeline.token_texts, token_ids, logprobs, request.top_logprobs or 0)

    def _events(
        self,
        request: ChatCompletionRequest,
        prompt: Prompt,
        first: tuple[int, RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        response_id: str,
        tools: str | None = None,
    ) -> AsyncIterator[str]:
        frame = EventFrame(response_id, "chat.completion.chunk", int(time.time()), self.pipeline.model_name(request))

        def to_choice(_: int, out: CompletionOutput, state: ChoiceProgress) -> str:
            if tools is not None:
                return self._tool_delta(request, tools, out, state).model_dump_json()
            if request.logprobs and out.token_ids:
                return self._delta(request, out, state).model_dump_json()
            state.num_tokens += len(out.token_ids)
            return chat_choice_json(out.index, out.text, out.finish_reason, out.stop_reason)

        # the role comes first, in a chunk of its own per choice
        role = DeltaMessage(role="assistant", content="")
        roles = [frame.event([ChatChunkChoice(index=i, delta=role).model_dump_json()]) for i in range(request.n)]
        return self.pipeline.stream_events(request, [prompt], first, outputs, to_choice, frame.event, roles)

    def _delta(self, request: ChatCompletionRequest, out: CompletionOutput, state: ChoiceProgress) -> ChatChunkChoice:
        logprobs = self._logprobs(request, out.token_ids, out.logprobs) if out.token_ids else None
        state.num_tokens += len(out.token_ids)
        return ChatChunkChoice(
            index=out.index,
            delta=DeltaMessage(content=out.text) if out.text else DeltaMessage(),
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )

    def _tool_delta(
        self, request: ChatCompletionRequest, mode: str, out: CompletionOutput, state: ChoiceProgress
    ) -> ChatChunkChoice:
        """A stream's delta when tool calls may come: a named function's arguments stream as
        they grow (delta.tool_calls[0].function.arguments); 'required' holds the text back
        and sends the calls with the choice's end; 'auto' sends content until a call may
        begin (the parser's ToolCallStream), then the calls (or the held text) at the end."""
        choice = self._delta(request, out, state)
        if mode == "forced" and named_function(request.tool_choice) is not None:
            if out.text:
                call: dict = {"index": 0, "function": {"arguments": out.text}}
                if not state.call_id:
                    state.call_id = ToolCall("", "").id
                    call.update(id=state.call_id, type="function")
                    call["function"] = {"name": named_function(request.tool_choice), "arguments": out.text}
                choice.delta = DeltaMessage(tool_calls=[call])
            if choice.finish_reason == "stop":
                choice.finish_reason = "tool_calls"
            return choice
        if mode == "auto":
            if state.tool_stream is None:
                state.tool_stream = ToolCallStream(self.tool_call_parser)
            content, calls = state.tool_stream.feed(out.text), []
            if out.finish_reason is not None:
                rest, calls = state.tool_stream.finish()
                content += rest
        else:
            state.held.append(out.text)
            content, calls = "", []
            if out.finish_reason is not None:
                content, calls = self._tool_calls(request, mode, "".join(state.held), out.finish_reason)
        choice.delta = DeltaMessage(content=content or None,
                                    tool_calls=[c.as_openai(i) for i, c in enumerate(calls)] or None)  # fmt: skip
        if calls:
            choice.finish_reason = "tool_calls"
        return choice


def chat_choice_json(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
    """A streamed ChatChunkChoice with content only (or an empty delta), as pydantic writes it."""
    delta = f'{{"content":{json_value(text)}}}' if text else "{}"
    return f'{{"index":{index},"delta":{delta},"logprobs":null,{reasons_json(finish_reason, stop_reason)}'


def _with_forced_tool_calls(request: ChatCompletionRequest, params: SamplingParams) -> SamplingParams:
    """tool_choice 'required' or a named function: the output is constrained to the calls."""
    if not request.tools or request.tool_choice in (None, "none", "auto"):
        if request.tool_choice not in (None, "none", "auto") and not request.tools:
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        return params
    try:
        schema = forced_schema(request.tools, request.tool_choice, request.parallel_tool_calls)
    except ToolChoiceError as exc:
        raise bad_request(str(exc)) from None
    if params.structured_outputs is not None:
        raise bad_request("tool_choice: cannot be combined with response_format or structured_outputs")
    if params.use_beam_search:
        raise bad_request("tool_choice: forced tool calls cannot be combined with use_beam_search")
    try:
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))
    except SamplingParamsError as exc:
        raise bad_request(f"tools: {exc}") from None
