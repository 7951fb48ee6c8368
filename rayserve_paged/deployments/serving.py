"""The generation pipeline behind the OpenAI routes, independent of FastAPI wiring:
validate -> tokenize (a thread pool) -> engine requests -> the response body or its SSE
events. The engine client streams deltas; each event carries what one engine step (or,
for a slow client, several) added to one request.

Invariant: every engine request an HTTP request starts is either seen finished or
aborted when that HTTP request ends, however it ends (error, client disconnect,
cancellation). The generators that own engine requests abort them in `finally`, from a
shielded task, so a cancelled HTTP task still gets its aborts through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from fastapi.responses import Response

from rayserve_paged.core.sequence import SamplingParams, SamplingParamsError, StructuredOutputsParams
from rayserve_paged.deployments.admission import Admission
from rayserve_paged.deployments.errors import (
    OpenAIError,
    bad_request,
    engine_unavailable,
    internal_error,
    overloaded,
    to_openai_error,
)
from rayserve_paged.deployments.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    constraint_field_names,
    requested_constraint,
    to_sampling_params,
)
from rayserve_paged.deployments.sse import (
    SSE_DONE,
    EventFrame,
    EventStreamResponse,
    json_response,
    json_value,
    sse_event,
)
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

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
TOKENIZER_THREADS = 2  # prompt tokenization and chat templates, off the event loop
MAX_TOKENIZER_QUEUE = 64  # tokenizer jobs queued or running; more are answered 503


class EngineClient(Protocol):
    """What the ingress needs from an engine (the LLMServer deployment, or a fake)."""

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


@dataclass(slots=True)
class _Prompt:
    text: str | None  # as the client sent it (None: token ids were sent)
    token_ids: list[int]


@dataclass(slots=True)
class _ChoiceProgress:
    """What a stream has sent of one choice."""

    num_tokens: int = 0
    text_offset: int = 0
    is_started: bool = False
    held: list[str] = dataclasses.field(default_factory=list)  # tool_choice "required": the calls' text so far
    tool_stream: ToolCallStream | None = None  # tool_choice "auto": what the parser holds back
    call_id: str = ""  # a named tool choice's call, streamed as its arguments grow


class OpenAIServing:
    """The logic behind the routes, independent of FastAPI wiring."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer,
        served_model_name: str,
        max_tokenizer_queue: int = MAX_TOKENIZER_QUEUE,
        enable_prompt_tokens_details: bool = False,
        tool_call_parser: str | None = None,
    ) -> None:
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: expected one of {', '.join(TOOL_CALL_PARSERS)} (got {tool_call_parser!r})")
        self.client = client
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_tokenizer_queue = max_tokenizer_queue
        # usage.prompt_tokens_details.cached_tokens tells whether someone sent a prefix
        # before: reported only when the operator turns it on (docs/DEPLOY.md, section 10)
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.num_tokenizer_jobs = 0  # queued or running in the pool (a job outlives a caller that left)
        self.tool_call_parser = tool_call_parser  # reads tool calls out of tool_choice "auto" outputs
        self._info: dict | None = None
        self._token_texts = TokenTexts(tokenizer)
        self._background: set[asyncio.Task] = set()  # detached aborts, referenced until done
        self._pool = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS, thread_name_prefix="tokenize")

    async def _in_pool(self, fn):
        """Tokenizer work (encoding, chat templates) off the event loop, in a bounded queue:
        a job past `max_tokenizer_queue` is a 503 + Retry-After, never a wait."""
        if self.num_tokenizer_jobs >= self.max_tokenizer_queue:
            raise overloaded(
                f"the server is overloaded: {self.num_tokenizer_jobs} tokenizer jobs are queued on this replica "
                f"(the limit is {self.max_tokenizer_queue}); retry later"
            )
        loop = asyncio.get_running_loop()
        self.num_tokenizer_jobs += 1
        job = self._pool.submit(fn)
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._tokenizer_job_done))
        return await asyncio.wrap_future(job)

    def _tokenizer_job_done(self) -> None:
        self.num_tokenizer_jobs -= 1

    # ---------------------------------------------------------------- model info, health

    async def model_info(self) -> dict:
        if self._info is None:
            try:
                self._info = await self.client.model_info()
            except Exception as exc:
                logger.warning("engine model_info failed: %r", exc)
                raise engine_unavailable("the engine is not available") from exc
        return self._info

    async def is_healthy(self) -> bool:
        try:
            await asyncio.wait_for(self.client.model_info(), HEALTH_TIMEOUT_S)
        except Exception as exc:
            logger.warning("health check failed: %r", exc)
            return False
        return True

    async def models(self) -> ModelList:
        return ModelList(data=[await self._model_card()])

    async def model(self, name: str) -> ModelCard:
        self.check_model(name)
        return await self._model_card()

    async def _model_card(self) -> ModelCard:
        info = await self.model_info()
        return ModelCard(id=self.served_model_name, max_model_len=info.get("max_model_len"))

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise OpenAIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    # ---------------------------------------------------------------- /v1/completions

    async def create_completion(self, request: CompletionRequest, admission: Admission | None = None) -> Response:
        _log_unknown_fields(request)
        self.check_model(request.model)
        info = await self.model_info()
        params = _sampling_params(request, info)
        if request.echo and request.logprobs is not None:
            raise bad_request("echo: cannot be combined with logprobs (prompt logprobs are not computed)")
        texts = _prompt_list(request.prompt)
        if admission is not None:
            admission.reserve_sequences(len(texts), params.best_of, "prompt" if len(texts) > 1 else _width_field(request))
        prompts = await self._in_pool(lambda: [self._completion_prompt(p) for p in texts])
        for prompt in prompts:
            _check_fits(prompt.token_ids, params.max_tokens, info, "prompt", "max_tokens")
        response_id = f"cmpl-{uuid.uuid4().hex}"
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        if request.stream:
            outputs = self._stream_outputs(prompts, params, request_ids)
            first = await _first_output(outputs, _engine_renames(request))
            events = self._completion_events(request, params, prompts, first, outputs, response_id)
            return EventStreamResponse(events, outputs)
        try:
            results = await self._generate_outputs(prompts, params, request_ids)
        except Exception as exc:
            raise to_openai_error(exc, _engine_renames(request)) from exc
        choices = [
            self._completion_choice(request, prompt, out, index * request.n + out.index)
            for index, (prompt, result) in enumerate(zip(prompts, results))
            for out in result.outputs
        ]
        body = CompletionResponse(
            id=response_id, model=self.served_model_name, choices=choices, usage=self._usage(prompts, results)
        )
        return json_response(body)

    def _completion_prompt(self, prompt: str | list[int]) -> _Prompt:
        if isinstance(prompt, str):
            return _Prompt(prompt, self._encode(prompt, "prompt"))
        return _Prompt(None, list(prompt))

    def _encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a text the tokenizer refuses (a ValueError, such as a
        UnicodeError, or a TypeError) is the client's 400 naming `field`: validation lets no
        such text through, this is the last guard. Anything else is the server's 500."""
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except (ValueError, TypeError) as exc:
            logger.warning("tokenization of %s failed: %s", field, type(exc).__name__)
            raise bad_request(f"{field}: the text cannot be tokenized ({type(exc).__name__})", param=field) from None

    def _echo_text(self, request: CompletionRequest, prompt: _Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids, skip_special_tokens=request.skip_special_tokens)

    def _completion_choice(
        self, request: CompletionRequest, prompt: _Prompt, out: CompletionOutput, index: int
    ) -> CompletionChoice:
        text = self._echo_text(request, prompt) + out.text if request.echo else out.text
        logprobs = None
        if request.logprobs is not None and out.logprobs is not None:
            logprobs, _ = self._completion_logprobs(out.token_ids, out.logprobs, 0)
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason
        )

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], text_offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """OpenAI completions logprobs for these tokens, and the text offset after them."""
        result = CompletionLogprobs()
        for token_id, top in zip(token_ids, logprobs):
            token = self._token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(top.get(token_id))
            alternatives = {self._token_text(t): lp for t, lp in top.items() if t != token_id}
            result.top_logprobs.append(alternatives | {token: top.get(token_id)})  # on a text clash the sampled wins
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result, text_offset

    def _completion_events(
        self,
        request: CompletionRequest,
        params: SamplingParams,
        prompts: list[_Prompt],
        first: tuple[int, RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        response_id: str,
    ) -> AsyncIterator[str]:
        frame = EventFrame(response_id, "text_completion", int(time.time()), self.served_model_name)

        def to_choice(index: int, out: CompletionOutput, state: _ChoiceProgress) -> str:
            return self._completion_delta(request, prompts[index], out, state, index * request.n + out.index)

        return self._stream_events(request, prompts, first, outputs, to_choice, frame.event)

    async def _stream_events(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        prompts: list[_Prompt],
        first: tuple[int, RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        to_choice,
        chunk,
        preamble: Iterable[str] = (),
    ) -> AsyncIterator[str]:
        """The SSE body both routes share: the preamble, one event per engine output (one
        request's step, or several steps a slow client had not read yet), the usage event
        when asked, then [DONE]; an engine failure mid-stream becomes an error event."""
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        progress: dict[int, _ChoiceProgress] = {}  # by choice index across prompts
        cached: dict[int, int] = {}  # prefix-cache hits by prompt

        def events(index: int, result: RequestOutput) -> Iterable[str]:
            cached[index] = max(cached.get(index, 0), result.num_cached_tokens)
            states = (progress.setdefault(index * request.n + out.index, _ChoiceProgress()) for out in result.outputs)
            choices = [to_choice(index, out, state) for out, state in zip(result.outputs, states)]
            if choices:
                yield chunk(choices, None)

        try:
            for event in preamble:
                yield event
            for event in events(*first):
                yield event
            async for index, result in outputs:
                for event in events(index, result):
                    yield event
            if include_usage:
                num_cached = sum(cached.values()) if self.enable_prompt_tokens_details else None
                yield chunk([], _stream_usage(prompts, progress.values(), num_cached))
            yield SSE_DONE
        except Exception as exc:
            yield sse_event(ErrorResponse(error=to_openai_error(exc, _engine_renames(request)).info))
            yield SSE_DONE
        finally:
            await outputs.aclose()

    def _completion_delta(
        self,
        request: CompletionRequest,
        prompt: _Prompt,
        out: CompletionOutput,
        state: _ChoiceProgress,
        choice_index: int,
    ) -> CompletionChoice:
        text = out.text
        if not state.is_started:
            state.is_started = True
            if request.echo:
                text = self._echo_text(request, prompt) + text
        logprobs = None
        if request.logprobs is not None and out.logprobs is not None and out.token_ids:
            logprobs, state.text_offset = self._completion_logprobs(out.token_ids, out.logprobs, state.text_offset)
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

    # ---------------------------------------------------------------- /v1/chat/completions

    async def create_chat_completion(
        self, request: ChatCompletionRequest, admission: Admission | None = None
    ) -> Response:
        _log_unknown_fields(request)
        self.check_model(request.model)
        info = await self.model_info()
        params = _with_forced_tool_calls(request, _sampling_params(request, info))
        if admission is not None:
            admission.reserve_sequences(1, params.best_of, _width_field(request))
        tools = self._tool_mode(request)
        prompt = await self._in_pool(lambda: self._chat_prompt(request))
        max_tokens_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        _check_fits(prompt.token_ids, params.max_tokens, info, "messages", max_tokens_field)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        request_ids = [f"{response_id}-0"]
        if request.stream:
            outputs = self._stream_outputs([prompt], params, request_ids)
            first = await _first_output(outputs, _engine_renames(request))
            events = self._chat_events(request, params, prompt, first, outputs, response_id, tools)
            return EventStreamResponse(events, outputs)
        try:
            (result,) = await self._generate_outputs([prompt], params, request_ids)
        except Exception as exc:
            raise to_openai_error(exc, _engine_renames(request)) from exc
        choices = []
        for out in result.outputs:
            content, calls = self._tool_calls(request, tools, out.text, out.finish_reason)
            choices.append(
                ChatChoice(
                    index=out.index,
                    message=AssistantMessage(content=content, tool_calls=[c.as_openai() for c in calls] or None),
                    logprobs=self._chat_logprobs(request, out.token_ids, out.logprobs),
                    finish_reason="tool_calls" if calls else out.finish_reason,
                    stop_reason=out.stop_reason,
                )
            )
        body = ChatCompletionResponse(
            id=response_id, model=self.served_model_name, choices=choices, usage=self._usage([prompt], [result])
        )
        return json_response(body)

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

    def _chat_prompt(self, request: ChatCompletionRequest, add_generation_prompt: bool = True) -> _Prompt:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request(
                f"messages: the model {self.served_model_name!r} has no chat template; use /v1/completions",
                param="messages",
            )
        messages = [m.for_template() for m in request.messages]
        options = {}
        if request.tools and request.tool_choice != "none":
            options["tools"] = request.tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **options
            )
        except Exception as exc:  # the template's own checks (e.g. role order) raise
            raise bad_request(f"messages: the chat template rejected the conversation: {exc}", param="messages")
        # the template renders the BOS itself: no special tokens added on top
        return _Prompt(text, self._encode(text, "messages", add_special_tokens=False))

    # ---------------------------------------------------------------- /tokenize, /detokenize

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        info = await self.model_info()
        if request.messages is not None:
            chat = ChatCompletionRequest(messages=request.messages)
            prompt = await self._in_pool(lambda: self._chat_prompt(chat, request.add_generation_prompt))
            token_ids = prompt.token_ids
        else:
            prompt, add_special = request.prompt, request.add_special_tokens
            token_ids = await self._in_pool(lambda: self._encode(prompt, "prompt", add_special))
        return TokenizeResponse(count=len(token_ids), max_model_len=info["max_model_len"], tokens=token_ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        info = await self.model_info()
        vocab_size = info.get("vocab_size")
        bad = next((t for t in request.tokens if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab_size})")
        return DetokenizeResponse(prompt=await self._in_pool(lambda: self.tokenizer.decode(request.tokens)))

    def _chat_logprobs(
        self, request: ChatCompletionRequest, token_ids: list[int], logprobs: list[dict[int, float]] | None
    ) -> ChatLogprobs | None:
        if not request.logprobs or logprobs is None:
            return None
        num_top = request.top_logprobs or 0
        content = []
        texts = self._token_texts
        for token_id, top in zip(token_ids, logprobs):
            best = sorted(top.items(), key=lambda item: item[1], reverse=True)[:num_top]
            content.append(
                ChatLogprobToken(
                    token=texts.text(token_id),
                    logprob=top.get(token_id, float("-inf")),
                    bytes=texts.bytes(token_id),
                    top_logprobs=[TopLogprob(token=texts.text(t), logprob=lp, bytes=texts.bytes(t)) for t, lp in best],
                )
            )
        return ChatLogprobs(content=content)

    def _chat_events(
        self,
        request: ChatCompletionRequest,
        params: SamplingParams,
        prompt: _Prompt,
        first: tuple[int, RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        response_id: str,
        tools: str | None = None,
    ) -> AsyncIterator[str]:
        frame = EventFrame(response_id, "chat.completion.chunk", int(time.time()), self.served_model_name)

        def to_choice(_: int, out: CompletionOutput, state: _ChoiceProgress) -> str:
            if tools is not None:
                return self._chat_tool_delta(request, tools, out, state).model_dump_json()
            if request.logprobs and out.token_ids:
                return self._chat_delta(request, out, state).model_dump_json()
            state.num_tokens += len(out.token_ids)
            return chat_choice_json(out.index, out.text, out.finish_reason, out.stop_reason)

        # the role comes first, in a chunk of its own per choice
        role = DeltaMessage(role="assistant", content="")
        roles = [frame.event([ChatChunkChoice(index=i, delta=role).model_dump_json()]) for i in range(request.n)]
        return self._stream_events(request, [prompt], first, outputs, to_choice, frame.event, roles)

    def _chat_delta(
        self, request: ChatCompletionRequest, out: CompletionOutput, state: _ChoiceProgress
    ) -> ChatChunkChoice:
        logprobs = self._chat_logprobs(request, out.token_ids, out.logprobs) if out.token_ids else None
        state.num_tokens += len(out.token_ids)
        return ChatChunkChoice(
            index=out.index,
            delta=DeltaMessage(content=out.text) if out.text else DeltaMessage(),
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )

    def _chat_tool_delta(
        self, request: ChatCompletionRequest, mode: str, out: CompletionOutput, state: _ChoiceProgress
    ) -> ChatChunkChoice:
        """A stream's delta when tool calls may come: a named function's arguments stream as
        they grow (delta.tool_calls[0].function.arguments); 'required' holds the text back
        and sends the calls with the choice's end; 'auto' sends content until a call may
        begin (the parser's ToolCallStream), then the calls (or the held text) at the end."""
        choice = self._chat_delta(request, out, state)
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

    # ---------------------------------------------------------------- engine requests

    async def _generate_outputs(
        self, prompts: list[_Prompt], params: SamplingParams, request_ids: list[str]
    ) -> list[RequestOutput]:
        """One engine request per prompt, concurrently; all aborted if any fails or we are cancelled."""
        tasks = [
            asyncio.ensure_future(self.client.generate(prompt.token_ids, params, request_id))
            for prompt, request_id in zip(prompts, request_ids)
        ]
        try:
            results = await asyncio.gather(*tasks)
            for result in results:
                _check_served(result)
            return results
        except BaseException:
            for task in tasks:
                task.cancel()
            await self._abort(request_ids)
            raise

    async def _stream_outputs(
        self, prompts: list[_Prompt], params: SamplingParams, request_ids: list[str]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) from all prompts' streams as they come.

        One prompt is read directly (the client's buffer coalesces what a slow reader has
        not read yet); several are pumped by a task each into one bounded queue. When this
        generator ends (done, error, closed or cancelled) every request not seen finished
        is aborted.
        """
        unfinished = set(request_ids)
        if len(prompts) == 1:
            stream = self.client.generate_stream(prompts[0].token_ids, params, request_ids[0])
            try:
                async for item in stream:
                    _check_served(item)
                    if item.finished:
                        unfinished.clear()
                    yield 0, item
            finally:
                if unfinished:
                    await self._abort(unfinished)
                await stream.aclose()
            return
        # bounded: a pump waits for a slow reader, and meanwhile the client's own buffer
        # coalesces that prompt's steps (the engine never waits)
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(prompts))

        async def pump(index: int, prompt: _Prompt, request_id: str) -> None:
            try:
                async for result in self.client.generate_stream(prompt.token_ids, params, request_id):
                    await queue.put((index, result))
            except Exception as exc:
                await queue.put((index, exc))
            else:
                await queue.put((index, None))  # this stream has ended

        pumps = [asyncio.ensure_future(pump(i, p, r)) for i, (p, r) in enumerate(zip(prompts, request_ids))]
        try:
            num_open = len(pumps)
            while num_open:
                index, item = await queue.get()
                if item is None:
                    num_open -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                _check_served(item)
                if item.finished:
                    unfinished.discard(item.request_id)
                yield index, item
        finally:
            for task in pumps:
                task.cancel()
            if unfinished:
                await self._abort(unfinished)

    async def _abort(self, request_ids: Iterable[str]) -> None:
        """Abort from a task of its own: when the caller is being cancelled (client gone),
        the shield is cancelled but the aborts still run to the end."""
        task = asyncio.ensure_future(self._abort_all(list(request_ids)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            pass  # the caller's own cancellation is already propagating

    async def _abort_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            try:
                await self.client.abort(request_id)
            except Exception as exc:
                logger.warning("abort of %s failed: %r", request_id, exc)

    def _token_text(self, token_id: int) -> str:
        return self._token_texts.text(token_id)

    def _usage(self, prompts: list[_Prompt], results: list[RequestOutput]) -> UsageInfo:
        num_completion = sum(len(out.token_ids) for result in results for out in result.outputs)
        num_cached = sum(r.num_cached_tokens for r in results) if self.enable_prompt_tokens_details else None
        return UsageInfo.of(sum(len(p.token_ids) for p in prompts), num_completion, num_cached)


class TokenTexts:
    """Each token's own text for logprobs, cached.

    A token that is only part of a UTF-8 character decodes to U+FFFD on its own; OpenAI
    writes such a token as "bytes:\\xe2\\x80". Its bytes come from the byte-level BPE
    alphabet (GPT-2's byte -> printable character map) or a "<0xNN>" byte-fallback piece.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._get(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._get(token_id)[1]

    def _get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._describe(token_id)
        return found

    def _describe(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode())
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        data = _raw_token_bytes(raw) if isinstance(raw, str) else None
        if data is None:
            return text, list(text.encode())
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand
    for themselves, the other bytes take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    alphabet = {chr(b): b for b in printable}
    extra = (b for b in range(256) if b not in set(printable))
    alphabet.update({chr(256 + i): b for i, b in enumerate(extra)})
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _raw_token_bytes(raw: str) -> list[int] | None:
    match = _BYTE_PIECE.match(raw)
    if match:
        return [int(match.group(1), 16)]
    if raw and all(ch in _BYTE_LEVEL for ch in raw):
        return [_BYTE_LEVEL[ch] for ch in raw]
    return None


MAX_LOGGED_FIELDS = 8  # unknown field names one log line names
MAX_LOGGED_FIELD_CHARS = 64  # of each name, once escaped


_UNFINISHED = '"finish_reason":null,"stop_reason":null}'


def _reasons(finish_reason: str | None, stop_reason: int | str | None) -> str:
    if finish_reason is None and stop_reason is None:  # every event but a choice's last
        return _UNFINISHED
    return f'"finish_reason":{json_value(finish_reason)},"stop_reason":{json_value(stop_reason)}}}'


def completion_choice_json(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
    """A streamed CompletionChoice without logprobs, as pydantic writes it."""
    return f'{{"index":{index},"text":{json_value(text)},"logprobs":null,{_reasons(finish_reason, stop_reason)}'


def chat_choice_json(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
    """A streamed ChatChunkChoice with content only (or an empty delta), as pydantic writes it."""
    delta = f'{{"content":{json_value(text)}}}' if text else "{}"
    return f'{{"index":{index},"delta":{delta},"logprobs":null,{_reasons(finish_reason, stop_reason)}'


def _log_unknown_fields(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Unknown fields are ignored, as vLLM's server does; the log says which, in one line
    of bounded length: names are the client's text, so each is escaped (a newline cannot
    forge a log line) and cut, and at most MAX_LOGGED_FIELDS are named."""
    unknown = request.unknown_fields()
    if not unknown:
        return
    names = sorted(unknown)
    shown = ", ".join(_loggable(name) for name in names[:MAX_LOGGED_FIELDS])
    more = f" (and {len(names) - MAX_LOGGED_FIELDS} more)" if len(names) > MAX_LOGGED_FIELDS else ""
    logger.warning("ignored %d unknown request fields: %s%s", len(names), shown, more)


def _loggable(name: str) -> str:
    """ASCII only, control characters and non-ASCII as backslash escapes, at most
    MAX_LOGGED_FIELD_CHARS characters (a cut name ends with "...")."""
    escaped = name.encode("unicode_escape").decode("ascii")
    if len(escaped) > MAX_LOGGED_FIELD_CHARS:
        return escaped[: MAX_LOGGED_FIELD_CHARS - 3] + "..."
    return escaped


def _engine_renames(request: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """Engine error field -> the request field the client wrote."""
    renames = {"prompt_token_ids": "prompt"}
    if isinstance(request, ChatCompletionRequest):
        renames = {"prompt_token_ids": "messages", "prompt": "messages", "logprobs": "top_logprobs"}
    if request.best_of is None:
        renames["best_of"] = "n"
    try:
        _, field = requested_constraint(request)
    except SamplingParamsError:
        field = ""
    if field:
        renames.update(constraint_field_names(field))
    elif isinstance(request, ChatCompletionRequest) and request.tool_choice not in (None, "none", "auto"):
        renames.update(constraint_field_names("tools"))
    return renames


def _width_field(request: CompletionRequest | ChatCompletionRequest) -> str:
    """The field that set how many sequences each prompt starts."""
    return "best_of" if request.best_of is not None else "n"


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


def _sampling_params(request: CompletionRequest | ChatCompletionRequest, info: dict) -> SamplingParams:
    try:
        return to_sampling_params(request, int(info.get("max_logprobs", 0)))
    except SamplingParamsError as exc:
        raise bad_request(str(exc)) from None


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _check_fits(token_ids: list[int], max_tokens: int | None, info: dict, prompt_field: str, max_field: str) -> None:
    vocab_size = info.get("vocab_size")
    if vocab_size is not None:
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"{prompt_field}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    max_model_len = info["max_model_len"]
    num_prompt = len(token_ids)
    if num_prompt >= max_model_len:
        raise bad_request(
            f"{prompt_field}: the prompt has {num_prompt} tokens, leaving no room to generate within "
            f"this model's maximum context length of {max_model_len} tokens"
        )
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise bad_request(
            f"{max_field}: this model's maximum context length is {max_model_len} tokens and the prompt has "
            f"{num_prompt}, so at most {max_model_len - num_prompt} can be generated (asked for {max_tokens})"
        )


def _check_served(result: RequestOutput) -> None:
    if result.error is not None:  # the engine ignored the request (a ValueError: answered 400)
        raise ValueError(f"prompt: {result.error}")


def _stream_usage(prompts: list[_Prompt], progress: Iterable[_ChoiceProgress], num_cached: int | None) -> UsageInfo:
    num_completion = sum(state.num_tokens for state in progress)
    return UsageInfo.of(sum(len(p.token_ids) for p in prompts), num_completion, num_cached)


async def _first_output(
    outputs: AsyncIterator[tuple[int, RequestOutput]], renames: dict[str, str]
) -> tuple[int, RequestOutput]:
    """The first output, awaited before any byte is sent: a request the engine rejects
    is an HTTP error, not an error event inside a 200 stream."""
    try:
        return await anext(outputs)
    except BaseException as exc:
        await outputs.aclose()
        if isinstance(exc, StopAsyncIteration):
            raise internal_error() from None
        if isinstance(exc, Exception):
            raise to_openai_error(exc, renames) from exc
        raise
