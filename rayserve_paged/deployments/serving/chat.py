"""/v1/chat/completions over the generation pipeline: the chat template, tool calls
(forced by tool_choice, or read by the deployment's parser), a thinking model's reasoning
(the deployment's reasoning parser), chat logprobs and the streamed chunks."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
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
    unicode_checked,
    documented,
)
from rayserve_paged.deployments.serving.logprobs import chat_logprobs
from rayserve_paged.deployments.serving.pipeline import ChoiceProgress, GenerationPipeline, Plan, Prompt, reasons_json
from rayserve_paged.deployments.sse import EventFrame, EventStreamResponse, json_response, json_value
from rayserve_paged.engine.outputs import CompletionOutput, RequestOutput
from rayserve_paged.engine.reasoning import ReasoningStream, check_reasoning_parser, end_token_id, is_thinking
from rayserve_paged.engine.tool_calls import (
    CallStart,
    Piece,
    ToolChoiceError,
    ToolSet,
    collect,
    forced_calls,
    forced_schema,
    forced_stream,
)
from rayserve_paged.engine.tool_parsers import ToolCallStream, check_parser

# chat_template_kwargs may not set what the server passes the template itself
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


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

    _check_text = unicode_checked("content", "name", "tool_call_id", "tool_calls")

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
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="More variables for the chat template, e.g. {'enable_thinking': false} (Qwen3); not the "
        "ones the server sets itself (messages, tools, add_generation_prompt, ...).",
    )

    _check_tools = unicode_checked("tools", "tool_choice")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value):
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(value or {}))
        if reserved:
            raise ValueError(f"{reserved[0]!r} is set by the server, not by chat_template_kwargs")
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
    reasoning_content: str | None = Field(
        None, description="A reasoning model's thinking (with the deployment's reasoning_parser)."
    )
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="The calls the model made: [{id, type: 'function', function: {name, arguments}}]."
    )

    @model_serializer(mode="wrap")
    def _no_absent_extras(self, handler):
        body = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if body.get(key) is None:
                body.pop(key, None)
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
    reasoning_content: str | None = None
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


@dataclass(slots=True)
class ReasoningText:
    text: str


class ChoiceReader:
    """One choice's output as the answer carries it: the reasoning (when the model thinks
    first), then the content and the tool calls (read by the request's tool stream). A
    stream feeds it each delta; a plain answer feeds it the whole text, so both agree."""

    def __init__(self, is_thinking: bool, tools) -> None:
        """`tools`: the request's tool stream (ToolCallStream, NamedCallStream or
        RequiredCallStream: feed / finish), or None."""
        self.reasoning = ReasoningStream() if is_thinking else None
        self.tools = tools
        self.num_calls = 0

    def feed(self, text: str) -> list[ReasoningText | Piece]:
        pieces: list[ReasoningText | Piece] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if thought:
                pieces.append(ReasoningText(thought))
        return pieces + self._content(self.tools.feed(text) if self.tools is not None else [text] if text else [])

    def finish(self) -> list[ReasoningText | Piece]:
        pieces: list[ReasoningText | Piece] = []
        if self.reasoning is not None:
            thought, _ = self.reasoning.finish()
            if thought:
                pieces.append(ReasoningText(thought))
        return pieces + self._content(self.tools.finish() if self.tools is not None else [])

    def _content(self, pieces: list[Piece]) -> list[Piece]:
        self.num_calls += sum(isinstance(p, CallStart) for p in pieces)
        return pieces


def split_reasoning(pieces: list[ReasoningText | Piece]) -> tuple[str | None, list[Piece]]:
    thought = "".join(p.text for p in pieces if isinstance(p, ReasoningText))
    return thought or None, [p for p in pieces if not isinstance(p, ReasoningText)]


def deltas_of(pieces: list[ReasoningText | Piece]) -> list[DeltaMessage]:
    """A stream's deltas for these pieces, in order: text pieces of one kind together; a
    call's first delta carries its id, type and name (arguments ""), its arguments follow."""
    deltas: list[DeltaMessage] = []
    for piece in pieces:
        last = deltas[-1] if deltas else None
        if isinstance(piece, ReasoningText):
            if last is not None and last.reasoning_content is not None:
                last.reasoning_content += piece.text
            else:
                deltas.append(DeltaMessage(reasoning_content=piece.text))
        elif isinstance(piece, str):
            if last is not None and last.content is not None:
                last.content += piece
            else:
                deltas.append(DeltaMessage(content=piece))
        elif isinstance(piece, CallStart):
            function = {"name": piece.call.name, "arguments": ""}
            deltas.append(DeltaMessage(tool_calls=[{"index": piece.index, "id": piece.call.id, "type": "function",
                                                    "function": function}]))  # fmt: skip
        elif last is not None and last.tool_calls and "id" not in last.tool_calls[0] \
                and last.tool_calls[0]["index"] == piece.index:  # fmt: skip
            last.tool_calls[0]["function"]["arguments"] += piece.text
        else:
            deltas.append(DeltaMessage(tool_calls=[{"index": piece.index, "function": {"arguments": piece.text}}]))
    return deltas


class ChatServing:
    def __init__(
        self, pipeline: GenerationPipeline, tool_call_parser: str | None = None, reasoning_parser: str | None = None
    ) -> None:
        self.pipeline = pipeline
        # reads tool calls out of tool_choice "auto" outputs
        self.tool_call_parser = None if tool_call_parser is None else check_parser(tool_call_parser)
        # moves a thinking model's reasoning into reasoning_content
        self.reasoning_parser = None if reasoning_parser is None else check_reasoning_parser(reasoning_parser)
        self.think_end_id = None if reasoning_parser is None else end_token_id(pipeline.tokenizer, reasoning_parser)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, admission: Admission | None = None
    ) -> Response:
        plan = await self.prepare(request, admission)
        pipeline = self.pipeline
        if request.stream:
            first, outputs = await pipeline.open_stream(request, plan.prompts, plan.params, plan.request_ids)
            events = self._events(request, plan.prompts[0], first, outputs, plan.response_id, plan.tools, plan.thinking)
            return EventStreamResponse(events, outputs)
        results = await pipeline.generate_body(request, plan.prompts, plan.params, plan.request_ids)
        return json_response(self.response(plan, results))

    async def prepare(self, request: ChatCompletionRequest, admission: Admission | None = None) -> Plan:
        """Everything before the engine: the model, the sampling parameters (with forced tool
        calls), the conversation through the chat template, its fit in the context, and
        where a thinking model's constraint starts."""
        pipeline = self.pipeline
        info, params = await pipeline.begin(request)
        tools = self._tool_mode(request)
        params = _with_forced_tool_calls(request, params)
        pipeline.reserve(admission, request, 1, params)
        prompt = await pipeline.in_pool(lambda: self.render(request))
        max_tokens_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        pipeline.check_fits(prompt.token_ids, params.max_tokens, info, "messages", max_tokens_field)
        thinking = is_thinking(self.reasoning_parser, prompt.text, request.chat_template_kwargs)
        if thinking and params.structured_outputs is not None:  # the constraint starts where the thinking ends
            constraint = dataclasses.replace(params.structured_outputs, after_token_id=self.think_end_id)
            params = dataclasses.replace(params, structured_outputs=constraint)
        return pipeline.plan(request, [prompt], params, f"chatcmpl-{uuid.uuid4().hex}", tools, thinking)

    def response(self, plan: Plan, results: list[RequestOutput]) -> ChatCompletionResponse:
        """The non-streamed body of a prepared request, from its finished result."""
        request, (result,) = plan.request, results
        choices = []
        for out in result.outputs:
            thought, content, calls = self._read(request, plan.tools, plan.thinking, out.text, out.finish_reason)
            message = AssistantMessage(content=content, reasoning_content=thought,
                                       tool_calls=[c.as_openai() for c in calls] or None)  # fmt: skip
            choices.append(
                ChatChoice(
                    index=out.index,
                    message=message,
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
        options = dict(request.chat_template_kwargs or {})
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

    def _tool_mode(self, request: ChatCompletionRequest) -> ToolSet | str | None:
        """How this request's tool calls are read: "forced" (required / named: the output
        is constrained to calls), the declared tools the deployment's parser checks calls
        against ("auto"), or None. "auto" (given, or implied by tools) without a parser is a
        400, as vLLM answers it."""
        if not request.tools or request.tool_choice == "none":
            return None
        if request.tool_choice not in (None, "auto"):
            return "forced"
        if self.tool_call_parser is None:
            raise bad_request(  # vLLM's words, which clients look for, then ours
                'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                "set (this deployment has no tool_call_parser; use tool_choice 'required', a named function or "
                "'none')",
                param="tool_choice",
            )
        try:
            return ToolSet(request.tools)
        except ToolChoiceError as exc:
            raise bad_request(str(exc)) from None

    def _reader(self, request: ChatCompletionRequest, mode: ToolSet | str | None, thinking: bool) -> ChoiceReader:
        if mode == "forced":
            tools = forced_stream(request.tool_choice)
        else:
            tools = None if mode is None else ToolCallStream(self.tool_call_parser, mode)
        return ChoiceReader(thinking, tools)

    def _read(
        self, request: ChatCompletionRequest, mode: ToolSet | str | None, thinking: bool, text: str,
        finish_reason: str | None,
    ) -> tuple[str | None, str | None, list]:  # fmt: skip
        """(reasoning, content, tool calls) of a finished choice. A forced call cut short
        (length, abort) is not a call: its text stays content."""
        reader = self._reader(request, None if mode == "forced" else mode, thinking)
        thought, pieces = split_reasoning([*reader.feed(text), *reader.finish()])
        content, calls = collect(pieces)
        if mode == "forced":
            calls = forced_calls(content or "", request.tool_choice) if finish_reason == "stop" else []
            content = None if calls else content
        elif mode is None and not thinking:
            content = text  # as generated ("" when empty)
        return thought, content, calls

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
        tools: ToolSet | str | None = None,
        thinking: bool = False,
    ) -> AsyncIterator[str]:
        frame = EventFrame(response_id, "chat.completion.chunk", int(time.time()), self.pipeline.model_name(request))
        is_read = tools is not None or thinking

        def to_choice(_: int, out: CompletionOutput, state: ChoiceProgress) -> str | list[str]:
            if is_read:
                if state.reader is None:
                    state.reader = self._reader(request, tools, thinking)
                return self._read_delta(request, tools == "forced", out, state)
            if request.logprobs and out.token_ids:
                return self._delta(request, out, state).model_dump_json()
            state.num_tokens += len(out.token_ids)
            return chat_choice_json(out.index, out.text, out.finish_reason, out.stop_reason)

        # the role comes first, in a chunk of its own per choice; with tool calls or reasoning
        # the content may stay null (an answer of calls alone), so the role chunk leaves it out
        role = DeltaMessage(role="assistant") if is_read else DeltaMessage(role="assistant", content="")
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

    def _read_delta(
        self, request: ChatCompletionRequest, is_forced: bool, out: CompletionOutput, state: ChoiceProgress
    ) -> list[str]:
        """A stream's chunks for one choice when its output is read (reasoning, tool calls),
        as OpenAI streams them: reasoning and content as they come; each call's id, type and
        name in a chunk of its own, then its arguments (a forced call's as they grow, a
        parsed call's once it is whole); the finish_reason in a last chunk of its own."""
        reader = state.reader
        pieces = reader.feed(out.text)
        if out.finish_reason is not None:
            pieces += reader.finish()
        logprobs = self._logprobs(request, out.token_ids, out.logprobs) if out.token_ids else None
        state.num_tokens += len(out.token_ids)
        choices = [ChatChunkChoice(index=out.index, delta=d) for d in deltas_of(pieces)]
        if logprobs is not None:
            if not choices:
                choices.append(ChatChunkChoice(index=out.index, delta=DeltaMessage()))
            choices[0].logprobs = logprobs
        if out.finish_reason is not None:
            finish = out.finish_reason
            if reader.num_calls and (finish == "stop" or not is_forced):
                finish = "tool_calls"
            choices.append(ChatChunkChoice(index=out.index, delta=DeltaMessage(), finish_reason=finish,
                                           stop_reason=out.stop_reason))  # fmt: skip
        return [c.model_dump_json() for c in choices]


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
