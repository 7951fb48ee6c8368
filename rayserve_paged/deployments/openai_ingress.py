"""The OpenAI-compatible HTTP front end: FastAPI routes over an engine client.

    HTTP ──> create_openai_app(client, tokenizer, ...)   validate, tokenize, SSE, errors
                 │ EngineClient: generate / generate_stream / abort / model_info
                 ▼
             HandleEngineClient(handle) ──> LLMServer deployment (Serve)      in production
             any in-process client      ──> LLMEngine                          in tests

Prompts are tokenized here, so usage counts and context-length errors are exact before
the engine sees a request; the engine receives token ids.

Invariant: every engine request an HTTP request starts is either seen finished or
aborted when that HTTP request ends, however it ends (error, client disconnect,
cancellation). The generators that own engine requests abort them in `finally`, from a
shielded task, so a cancelled HTTP task still gets its aborts through.

Limits, checked before any work (outermost first):

    API key        401   constant-time compare; /health is open
    admission      503   at most `max_pending_requests` generation requests in flight here
    body size      413   Content-Length first, then the bytes actually received
    handle         503   Serve's BackPressureError (LLMServer's max_queued_requests)

Both 503s are the same error (code "overloaded", a Retry-After header), like Serve's own.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rayserve_paged.core.sequence import SamplingParams, SamplingParamsError
from rayserve_paged.deployments.access import DEFAULT_OPEN_PATHS, api_key_from_env
from rayserve_paged.deployments.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    param_of,
    to_sampling_params,
)
from rayserve_paged.engine.outputs import CompletionOutput, RequestOutput
from rayserve_paged.telemetry import PROMETHEUS_CONTENT_TYPE

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20  # 1 MiB: 128 prompts of ~2k tokens fit easily
DEFAULT_MAX_PENDING_REQUESTS = 256  # per ingress replica
RETRY_AFTER_S = 1  # the Retry-After of an overloaded answer, unless Serve gives its own
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # what admission counts


class EngineClient(Protocol):
    """What the ingress needs from an engine (the LLMServer deployment, or a fake)."""

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str
    ) -> RequestOutput: ...

    def generate_stream(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs, one per engine step in which the request advanced; the last is finished."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def model_info(self) -> dict:
        """{"model", "max_model_len", "vocab_size", "max_logprobs"}."""
        ...

    async def metrics_text(self) -> str:
        """Prometheus exposition text of the engine's metrics."""
        ...


class HandleEngineClient:
    """EngineClient over a Serve DeploymentHandle to the LLMServer deployment."""

    def __init__(self, handle) -> None:
        self._handle = handle
        self._stream_handle = handle.options(stream=True)

    async def generate(self, prompt, sampling_params, request_id) -> RequestOutput:
        return await self._handle.generate.remote(prompt, sampling_params, request_id)

    async def generate_stream(self, prompt, sampling_params, request_id) -> AsyncIterator[RequestOutput]:
        response = self._stream_handle.generate_stream.remote(prompt, sampling_params, request_id)
        is_finished = False
        try:
            async for output in response:
                is_finished = output.finished
                yield output
        finally:
            if not is_finished:
                response.cancel()  # best effort; the ingress also aborts the request by id

    async def abort(self, request_id: str) -> None:
        await self._handle.abort.remote(request_id)

    async def model_info(self) -> dict:
        return await self._handle.model_info.remote()

    async def metrics_text(self) -> str:
        return await self._handle.fleet_metrics_text.remote()  # every replica, merged


# --------------------------------------------------------------------------- errors


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})
        if status_code == 401:
            self.headers["WWW-Authenticate"] = "Bearer"

    def response(self) -> Response:
        return _json(ErrorResponse(error=self.info), self.status_code, self.headers or None)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param if param is not None else param_of(message))


def overloaded(message: str, retry_after_s: float | None = None) -> OpenAIError:
    """503 with a Retry-After (whole seconds, rounded up): the openai client retries it."""
    seconds = RETRY_AFTER_S if retry_after_s is None else max(0, math.ceil(retry_after_s))
    return OpenAIError(
        503, message, type="server_error", code="overloaded", headers={"Retry-After": str(seconds)}
    )


class RequestBodyTooLarge(StarletteHTTPException):
    """Raised while the body is read. An HTTPException, so FastAPI's body parsing lets it
    through instead of turning it into "There was an error parsing the body"."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413)
        self.error = OpenAIError(
            413,
            f"the request body is larger than this server's limit of {max_bytes} bytes",
            code="request_too_large",
        )


def _internal_error() -> OpenAIError:
    return OpenAIError(500, "internal server error (see the server log)", type="server_error")


def to_openai_error(exc: Exception, renames: dict[str, str] | None = None) -> OpenAIError:
    """OpenAIError as is; Serve's back-pressure -> 503 overloaded; engine ValueErrors
    (RequestError, SamplingParamsError, possibly wrapped in a RayTaskError that is still a
    ValueError) -> 400; anything else -> 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, BackPressureError):
        return overloaded(
            "the server is overloaded: the engine's request queue is full; retry later",
            getattr(exc, "retry_after_s", None),
        )
    if isinstance(exc, ValueError):
        cause = getattr(exc, "cause", None)  # RayTaskError: the engine's own exception
        message = str(cause if isinstance(cause, ValueError) else exc)
        field = param_of(message)
        if renames and field in renames:
            message = renames[field] + message[len(field) :]
            field = renames[field]
        return OpenAIError(400, message, param=field)
    logger.error("request failed", exc_info=exc)
    return _internal_error()


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 as an OpenAI 400 naming the field(s)."""
    problems: dict[str, list[str]] = {}
    for error in exc.errors():
        kind = error.get("type", "")
        if kind == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", "")
            return OpenAIError(400, f"invalid JSON body: {detail}".rstrip(": "))
        field = _field_path(error.get("loc", ()))
        if kind == "extra_forbidden":
            message = "unknown field (not supported by this server)"
        elif kind == "missing":
            message = "field required"
        else:
            message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if message not in problems.setdefault(field, []):
            problems[field].append(message)
    if not problems:
        return OpenAIError(400, "invalid request body")
    text = "; ".join(f"{field or 'body'}: {', '.join(messages)}" for field, messages in list(problems.items())[:3])
    first = next(iter(problems))
    return OpenAIError(400, text, param=first or None)


def _field_path(loc: Iterable[Any]) -> str:
    """("body", "messages", 0, "content", "str") -> "messages[0].content" (union member tags dropped)."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_TAGS:
            path += f".{part}" if path else part
    return path


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "literal"})


def _body_parse_error(cause: BaseException | None) -> OpenAIError:
    """FastAPI's "There was an error parsing the body" (a body json.loads raised on, other
    than a JSONDecodeError) as a 400 that says what is wrong with the body."""
    if isinstance(cause, UnicodeDecodeError):
        why = f"not UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset {cause.start})"
    elif isinstance(cause, RecursionError):
        why = "nested too deeply"
    else:
        why = "not parsable"
    return OpenAIError(400, f"invalid JSON body: {why}")


# --------------------------------------------------------------------------- serving


@dataclass(slots=True)
class _Prompt:
    text: str | None  # as the client sent it (None: token ids were sent)
    token_ids: list[int]


@dataclass(slots=True)
class _ChoiceProgress:
    """How much of one choice's cumulative output a stream has already sent."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    is_started: bool = False
    is_finished: bool = False


class OpenAIServing:
    """The logic behind the routes, independent of FastAPI wiring."""

    def __init__(self, client: EngineClient, tokenizer, served_model_name: str) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self._info: dict | None = None
        self._token_texts = TokenTexts(tokenizer)
        self._background: set[asyncio.Task] = set()  # detached aborts, referenced until done

    # ---------------------------------------------------------------- model info, health

    async def model_info(self) -> dict:
        if self._info is None:
            try:
                self._info = await self.client.model_info()
            except Exception as exc:
                logger.warning("engine model_info failed: %r", exc)
                raise OpenAIError(
                    503, "the engine is not available", type="server_error", code="engine_unavailable"
                ) from exc
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

    async def create_completion(self, request: CompletionRequest) -> Response:
        self.check_model(request.model)
        info = await self.model_info()
        params = _sampling_params(request, info)
        if request.echo and request.logprobs is not None:
            raise bad_request("echo: cannot be combined with logprobs (prompt logprobs are not computed)")
        prompts = [self._completion_prompt(p) for p in _prompt_list(request.prompt)]
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
            id=response_id, model=self.served_model_name, choices=choices, usage=_usage(prompts, results)
        )
        return _json(body)

    def _completion_prompt(self, prompt: str | list[int]) -> _Prompt:
        if isinstance(prompt, str):
            return _Prompt(prompt, list(self.tokenizer(prompt).input_ids))
        return _Prompt(None, list(prompt))

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

    async def _completion_events(
        self,
        request: CompletionRequest,
        params: SamplingParams,
        prompts: list[_Prompt],
        first: tuple[int, RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        response_id: str,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        holdback = _stop_holdback(params)
        progress: dict[int, _ChoiceProgress] = {}
        latest: dict[int, RequestOutput] = {}

        def chunks(index: int, result: RequestOutput) -> Iterable[str]:
            latest[index] = result
            for out in result.outputs:
                choice_index = index * request.n + out.index
                state = progress.setdefault(choice_index, _ChoiceProgress())
                choice = self._completion_delta(request, prompts[index], out, state, holdback, choice_index)
                if choice is not None:
                    yield _sse(
                        CompletionStreamResponse(
                            id=response_id, created=created, model=self.served_model_name, choices=[choice]
                        )
                    )

        try:
            for event in chunks(*first):
                yield event
            async for index, result in outputs:
                for event in chunks(index, result):
                    yield event
            if include_usage:
                usage = _usage(prompts, [latest[i] for i in sorted(latest)])
                chunk = CompletionStreamResponse(
                    id=response_id, created=created, model=self.served_model_name, choices=[], usage=usage
                )
                yield _sse(chunk)
            yield _SSE_DONE
        except Exception as exc:
            yield _sse(ErrorResponse(error=to_openai_error(exc, _engine_renames(request)).info))
            yield _SSE_DONE
        finally:
            await outputs.aclose()

    def _completion_delta(
        self,
        request: CompletionRequest,
        prompt: _Prompt,
        out: CompletionOutput,
        state: _ChoiceProgress,
        holdback: int,
        choice_index: int,
    ) -> CompletionChoice | None:
        text = _take_text(out, state, holdback)
        if not state.is_started:
            state.is_started = True
            if request.echo:
                text = self._echo_text(request, prompt) + text
        logprobs = None
        new_token_ids = out.token_ids[state.num_tokens :]
        if request.logprobs is not None and out.logprobs is not None and new_token_ids:
            new_logprobs = out.logprobs[state.num_tokens : len(out.token_ids)]
            logprobs, state.text_offset = self._completion_logprobs(new_token_ids, new_logprobs, state.text_offset)
        state.num_tokens = len(out.token_ids)
        is_finishing = out.finish_reason is not None and not state.is_finished
        if not text and logprobs is None and not is_finishing:
            return None
        state.is_finished = state.is_finished or is_finishing
        return CompletionChoice(
            index=choice_index,
            text=text,
            logprobs=logprobs,
            finish_reason=out.finish_reason if is_finishing else None,
            stop_reason=out.stop_reason if is_finishing else None,
        )

    # ---------------------------------------------------------------- /v1/chat/completions

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        self.check_model(request.model)
        info = await self.model_info()
        params = _sampling_params(request, info)
        prompt = self._chat_prompt(request)
        max_tokens_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        _check_fits(prompt.token_ids, params.max_tokens, info, "messages", max_tokens_field)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        request_ids = [f"{response_id}-0"]
        if request.stream:
            outputs = self._stream_outputs([prompt], params, request_ids)
            first = await _first_output(outputs, _engine_renames(request))
            events = self._chat_events(request, params, prompt, first, outputs, response_id)
            return EventStreamResponse(events, outputs)
        try:
            (result,) = await self._generate_outputs([prompt], params, request_ids)
        except Exception as exc:
            raise to_openai_error(exc, _engine_renames(request)) from exc
        choices = [
            ChatChoice(
                index=out.index,
                message=AssistantMessage(content=out.text),
                logprobs=self._chat_logprobs(request, out.token_ids, out.logprobs),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            for out in result.outputs
        ]
        body = ChatCompletionResponse(
            id=response_id, model=self.served_model_name, choices=choices, usage=_usage([prompt], [result])
        )
        return _json(body)

    def _chat_prompt(self, request: ChatCompletionRequest) -> _Prompt:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request(
                f"messages: the model {self.served_model_name!r} has no chat template; use /v1/completions",
                param="messages",
            )
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in request.messages
        ]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (e.g. role order) raise
            raise bad_request(f"messages: the chat template rejected the conversation: {exc}", param="messages")
        # the template renders the BOS itself: no special tokens added on top
        return _Prompt(text, list(self.tokenizer(text, add_special_tokens=False).input_ids))

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

    async def _chat_events(
        self,
        request: ChatCompletionRequest,
        params: SamplingParams,
        prompt: _Prompt,
        first: tuple[int, RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        response_id: str,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        holdback = _stop_holdback(params)
        progress = [_ChoiceProgress() for _ in range(request.n)]
        latest = first[1]

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionChunk(
                id=response_id, created=created, model=self.served_model_name, choices=choices, usage=usage
            )
            return _sse(body)

        def deltas(result: RequestOutput) -> Iterable[str]:
            for out in result.outputs:
                choice = self._chat_delta(request, out, progress[out.index], holdback)
                if choice is not None:
                    yield chunk([choice])

        try:
            for index in range(request.n):  # the role comes first, in a chunk of its own
                yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            for event in deltas(latest):
                yield event
            async for _, latest in outputs:
                for event in deltas(latest):
                    yield event
            if include_usage:
                yield chunk([], usage=_usage([prompt], [latest]))
            yield _SSE_DONE
        except Exception as exc:
            yield _sse(ErrorResponse(error=to_openai_error(exc, _engine_renames(request)).info))
            yield _SSE_DONE
        finally:
            await outputs.aclose()

    def _chat_delta(
        self, request: ChatCompletionRequest, out: CompletionOutput, state: _ChoiceProgress, holdback: int
    ) -> ChatChunkChoice | None:
        text = _take_text(out, state, holdback)
        new_token_ids = out.token_ids[state.num_tokens :]
        new_logprobs = out.logprobs[state.num_tokens : len(out.token_ids)] if out.logprobs is not None else None
        logprobs = self._chat_logprobs(request, new_token_ids, new_logprobs) if new_token_ids else None
        state.num_tokens = len(out.token_ids)
        is_finishing = out.finish_reason is not None and not state.is_finished
        if not text and logprobs is None and not is_finishing:
            return None
        state.is_finished = state.is_finished or is_finishing
        return ChatChunkChoice(
            index=out.index,
            delta=DeltaMessage(content=text) if text else DeltaMessage(),
            logprobs=logprobs,
            finish_reason=out.finish_reason if is_finishing else None,
            stop_reason=out.stop_reason if is_finishing else None,
        )

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
        """(prompt index, cumulative output) from all prompts' streams as they come.

        Each stream is pumped by its own task into one queue; when this generator ends
        (done, error, closed or cancelled) the pumps are cancelled and every request not
        seen finished is aborted.
        """
        queue: asyncio.Queue = asyncio.Queue()
        unfinished = set(request_ids)

        async def pump(index: int, prompt: _Prompt, request_id: str) -> None:
            try:
                async for result in self.client.generate_stream(prompt.token_ids, params, request_id):
                    queue.put_nowait((index, result))
            except Exception as exc:
                queue.put_nowait((index, exc))
            else:
                queue.put_nowait((index, None))  # this stream has ended

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


def _engine_renames(request: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """Engine error field -> the request field the client wrote."""
    renames = {"prompt_token_ids": "prompt"}
    if isinstance(request, ChatCompletionRequest):
        renames = {"prompt_token_ids": "messages", "prompt": "messages", "logprobs": "top_logprobs"}
    if request.best_of is None:
        renames["best_of"] = "n"
    return renames


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


def _stop_holdback(params: SamplingParams) -> int:
    """Characters a stream keeps back: the engine cuts a matched stop string out of the
    text, so a possible stop-string prefix at the end must not be sent yet."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


def _take_text(out: CompletionOutput, state: _ChoiceProgress, holdback: int) -> str:
    """The text of `out` not yet sent, less the holdback while the choice runs."""
    end = len(out.text) if out.finish_reason is not None else len(out.text) - holdback
    if end <= state.num_chars:
        return ""
    delta = out.text[state.num_chars : end]
    state.num_chars = end
    return delta


def _usage(prompts: list[_Prompt], results: Iterable[RequestOutput]) -> UsageInfo:
    num_completion = sum(len(out.token_ids) for result in results for out in result.outputs)
    return UsageInfo.of(sum(len(p.token_ids) for p in prompts), num_completion)


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
            raise _internal_error() from None
        if isinstance(exc, Exception):
            raise to_openai_error(exc, renames) from exc
        raise


_SSE_DONE = "data: [DONE]\n\n"


def _json(body: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    # pydantic's JSON writes a non-finite logprob as null where json.dumps would fail
    return Response(body.model_dump_json(), status_code=status_code, headers=headers, media_type="application/json")


def _sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events that always close their generator, however the response ends.

    Starlette leaves the body iterator suspended when a send fails or the task is
    cancelled between chunks, and never starts it when the client leaves first; closing
    the events and then the engine outputs they read runs the `finally` that aborts.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], outputs: AsyncIterator) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._outputs = outputs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._outputs.aclose()


# --------------------------------------------------------------------------- the app


class _APIKeyMiddleware:
    """Every route except the open ones needs `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._key = api_key.encode()
        self._open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or _route_path(scope) in self._open_paths:
            return await self.app(scope, receive, send)
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key):
            return await self.app(scope, receive, send)
        error = OpenAIError(
            401,
            "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
        await error.response()(scope, receive, send)


@dataclass(slots=True)
class AdmissionLimit:
    """Generation requests in flight in this ingress replica, from arrival until the last
    byte of the answer (a stream included) or the client leaving."""

    max_pending: int
    num_pending: int = 0

    def can_admit(self) -> bool:
        return self.num_pending < self.max_pending


class _AdmissionMiddleware:
    """Over the limit, a generation request is answered 503 at once: it never waits in an
    unbounded queue, never reads its body, never reaches the engine."""

    def __init__(self, app, limit: AdmissionLimit) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or _route_path(scope) not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if not self.limit.can_admit():
            error = overloaded(
                f"the server is overloaded: {self.limit.num_pending} requests are in flight on this "
                f"replica (the limit is {self.limit.max_pending}); retry later"
            )
            return await error.response()(scope, receive, send)
        self.limit.num_pending += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.limit.num_pending -= 1


class _BodySizeLimitMiddleware:
    """A body over `max_bytes` is a 413 before it is parsed: a declared Content-Length is
    checked before a byte is read, and the bytes received are counted as they arrive (a
    chunked body, or one longer than declared), so at most max_bytes + one chunk are held."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return await OpenAIError(400, "invalid Content-Length header").response()(scope, receive, send)
            if int(declared) > self.max_bytes:
                return await RequestBodyTooLarge(self.max_bytes).error.response()(scope, receive, send)
        num_received = 0

        async def counting_receive():
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    raise RequestBodyTooLarge(self.max_bytes)
            return message

        is_started = False

        async def tracking_send(message) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except RequestBodyTooLarge as exc:  # read outside a route's body parsing
            if is_started:
                raise
            await exc.error.response()(scope, receive, send)


class _InternalErrorMiddleware:
    """An exception no handler took becomes a logged, generic OpenAI-shaped 500."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        is_started = False

        async def tracking_send(message) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            raise  # the client left: nothing to answer, nothing went wrong here
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if is_started:
                raise
            await _internal_error().response()(scope, receive, send)


def _route_path(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def create_openai_app(
    client: EngineClient,
    tokenizer,
    served_model_name: str,
    api_key: str | None = None,
    *,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
    open_paths: Iterable[str] = DEFAULT_OPEN_PATHS,
) -> FastAPI:
    """The OpenAI-compatible FastAPI app over `client` (docs/API.md describes the API).
    With `api_key`, every route but `open_paths` requires it."""
    serving = OpenAIServing(client, tokenizer, served_model_name)
    app = FastAPI(
        title="rayserve-paged",
        summary="OpenAI-compatible LLM serving with PagedAttention on Ray Serve",
    )
    app.state.serving = serving
    app.state.admission = admission = AdmissionLimit(max_pending_requests)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_, exc: RequestValidationError) -> Response:
        return _validation_error(exc).response()

    @app.exception_handler(RequestBodyTooLarge)
    async def _body_too_large(_, exc: RequestBodyTooLarge) -> Response:
        return exc.error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and exc.__cause__ is not None:  # the body could not be read as JSON
            return _body_parse_error(exc.__cause__).response()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return OpenAIError(exc.status_code, message, type=kind).response()

    @app.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}})
    async def completions(request: CompletionRequest) -> Response:
        return await serving.create_completion(request)

    @app.post("/v1/chat/completions", response_model=None, responses={200: {"model": ChatCompletionResponse}})
    async def chat_completions(request: ChatCompletionRequest) -> Response:
        return await serving.create_chat_completion(request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return await serving.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        return await serving.model(model)

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        """Prometheus text of every LLMServer replica, merged (each series has a `replica` label)."""
        return Response(await serving.client.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/health", response_model=None)
    async def health() -> Response:
        if await serving.is_healthy():
            return JSONResponse({"status": "ok"})
        return OpenAIError(503, "the engine is not healthy", type="server_error", code="engine_unavailable").response()

    # the last added runs first: API key, admission, internal errors, body size, the routes
    app.add_middleware(_BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    app.add_middleware(_InternalErrorMiddleware)
    app.add_middleware(_AdmissionMiddleware, limit=admission)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, open_paths=frozenset(open_paths))
    return app


# --------------------------------------------------------------------------- Serve


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The tokenizer of a local directory or hub id (only its tokenizer files are fetched);
    "tiny-opt" / "tiny-llama" resolve, as in the engine, to the cached tiny checkpoint,
    written on this node if missing."""
    from transformers import AutoTokenizer

    path = str(name_or_path)
    if not Path(path).expanduser().is_dir():
        from rayserve_paged.models.tiny import TINY_MODELS, resolve_model  # imports torch

        if path in TINY_MODELS:
            path = str(resolve_model(path))
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


# Serve mechanism: `serve.ingress()` without an app (Ray 2.60's late-bound ingress). Serve
# constructs the class on the replica, then calls `__serve_build_asgi_app__` and serves
# the FastAPI app it returns. The app closes over this replica's handle, tokenizer and
# key, so it is the same `create_openai_app` the tests drive with an in-process engine.
# (`serve.ingress(app)` would need the app at import time, before the handle exists.)
# The builder applies `serve.deployment(OpenAIIngress, ...)`.
@serve.ingress()
class OpenAIIngress:
    """The HTTP ingress deployment: OpenAI API over a handle to the LLMServer deployment."""

    def __init__(
        self,
        llm_handle,
        tokenizer_path: str,
        served_model_name: str,
        api_key: str | None = None,
        trust_remote_code: bool = False,
        max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
        max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
        open_paths: Iterable[str] = DEFAULT_OPEN_PATHS,
    ) -> None:
        self._client = HandleEngineClient(llm_handle)
        self._tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
        self._served_model_name = served_model_name
        self._api_key = api_key or api_key_from_env()
        self._limits = {
            "max_request_body_bytes": max_request_body_bytes,
            "max_pending_requests": max_pending_requests,
            "open_paths": tuple(open_paths),
        }

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_openai_app(
            self._client, self._tokenizer, self._served_model_name, self._api_key, **self._limits
        )
