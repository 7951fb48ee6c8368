"""The generation pipeline every route family shares: validate -> tokenize (the replica's
thread pool) -> engine requests -> the response body or its SSE events. The engine client
streams deltas; each event carries what one engine step (or, for a slow client, several)
added to one request.

Invariant: every engine request an HTTP request starts is either seen finished or
aborted when that HTTP request ends, however it ends (error, client disconnect,
cancellation). The generators that own engine requests abort them in `finally`, from a
shielded task, so a cancelled HTTP task still gets its aborts through.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from rayserve_paged.core.sequence import SamplingParams, SamplingParamsError
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
    ErrorResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    UsageInfo,
    engine_renames,
    to_sampling_params,
)
from rayserve_paged.deployments.serving.logprobs import TokenTexts
from rayserve_paged.deployments.sse import SSE_DONE, json_value, sse_event
from rayserve_paged.deployments.tokenizer_pool import TokenizerPool
from rayserve_paged.engine.outputs import CompletionOutput, RequestOutput
from rayserve_paged.engine.protocol import EngineClient

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
# the bytes of request bodies whose tokenizer jobs are queued or running; more are answered
# 503 (a 1 MiB text takes the two threads of a small CPU ~0.5 s: 8 MiB is ~4 s of work)
MAX_TOKENIZER_QUEUE_BYTES = 8 << 20
# the weight of the current HTTP request's tokenizer jobs: its body's size (the ingress's
# body middleware sets it; tokenizer work is bounded by the text the body carries)
REQUEST_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("request_bytes", default=0)
# normalizers that never make a text shorter by more than this factor in characters
# (composition: at most a base and three marks become one character); others may drop
# text (strip, control-character removal), so no length bound is derived under them
_BOUNDED_NORMALIZERS = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Prepend": 1, "Lowercase": 1}
MAX_LOGGED_FIELDS = 8  # unknown field names one log line names
MAX_LOGGED_FIELD_CHARS = 64  # of each name, once escaped


@dataclass(slots=True)
class Prompt:
    text: str | None  # as the client sent it (None: token ids were sent)
    token_ids: list[int]


@dataclass(slots=True)
class ChoiceProgress:
    """What a stream has sent of one choice."""

    num_tokens: int = 0
    text_offset: int = 0
    is_started: bool = False
    reader: object | None = None  # chat: what reads the choice's reasoning and tool calls as they stream


@dataclass(slots=True)
class Plan:
    """A generation request made ready for the engine by a route's `prepare` (validated,
    tokenized, fitted), with what its body needs afterwards. Plain data: a batch job
    (deployments/serving/batch_routes.py) carries it from a CPU task past the engine to the
    task that writes the body."""

    request: GenerationRequest
    prompts: list[Prompt]
    params: SamplingParams
    response_id: str
    request_ids: list[str]  # one engine request per prompt
    lora_name: str | None  # the registered LoRA adapter it runs on (None: the base model)
    tools: str | None = None  # chat: how tool calls are read ("forced", "auto", or None)
    thinking: bool = False  # chat: the output starts in a thinking model's reasoning


# (prompt index, output, its progress) -> one streamed choice's JSON, or several (each then
# goes in an event of its own, in order)
ToChoice = Callable[[int, CompletionOutput, ChoiceProgress], str | list[str]]


class GenerationPipeline:
    """What the route families share: the engine client, the tokenizer and its pool, model
    info, engine requests and the SSE body."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer,
        served_model_name: str,
        max_tokenizer_queue_bytes: int = MAX_TOKENIZER_QUEUE_BYTES,
        enable_prompt_tokens_details: bool = False,
        tokenizer_pool: TokenizerPool | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_tokenizer_queue_bytes = max_tokenizer_queue_bytes
        # usage.prompt_tokens_details.cached_tokens tells whether someone sent a prefix
        # before: reported only when the operator turns it on (docs/DEPLOY.md, section 10)
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.token_texts = TokenTexts(tokenizer)
        self.tokenizer_pool = tokenizer_pool or TokenizerPool()
        self._info: dict | None = None
        self._max_chars_per_token: int | None | bool = False  # False: not computed yet
        self._background: set[asyncio.Task] = set()  # detached aborts, referenced until done

    @property
    def num_tokenizer_jobs(self) -> int:
        return self.tokenizer_pool.num_jobs

    async def in_pool(self, fn):
        """Tokenizer work (encoding, chat templates) off the event loop, in a queue bounded
        by bytes: each job weighs its request's body, and one that would take the queued
        bytes past `max_tokenizer_queue_bytes` is a 503 + Retry-After, never a wait (a job
        finding the queue empty always runs)."""
        pool = self.tokenizer_pool
        num_bytes = REQUEST_BYTES.get()
        if pool.num_jobs and pool.num_bytes + num_bytes > self.max_tokenizer_queue_bytes:
            raise overloaded(
                f"the server is overloaded: {pool.num_jobs} tokenizer jobs of {pool.num_bytes} bytes are queued on "
                f"this replica and this one has {num_bytes} (the limit is {self.max_tokenizer_queue_bytes} bytes, "
                "max_tokenizer_queue_bytes); retry later"
            )
        return await pool.run(fn, num_bytes)

    def encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a text the tokenizer refuses (a ValueError, such as a
        UnicodeError, or a TypeError) is the client's 400 naming `field`: validation lets no
        such text through, this is the last guard. Anything else is the server's 500.

        A text surely longer than the model's context is a 400 before it is tokenized: its
        tokens are at least its characters over the vocabulary's longest token (in
        characters, times what the normalizer may merge), so a flood of large bodies costs
        the tokenizer nothing."""
        self._check_length(text, field)
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except (ValueError, TypeError) as exc:
            logger.warning("tokenization of %s failed: %s", field, type(exc).__name__)
            raise bad_request(f"{field}: the text cannot be tokenized ({type(exc).__name__})", param=field) from None

    def _check_length(self, text: str, field: str) -> None:
        if self._info is None:
            return
        if self._max_chars_per_token is False:
            self._max_chars_per_token = max_chars_per_token(self.tokenizer)
        chars_per_token = self._max_chars_per_token
        max_model_len = self._info["max_model_len"]
        if chars_per_token is not None and len(text) > max_model_len * chars_per_token:
            raise bad_request(
                f"{field}: the text has {len(text)} characters, more than this model's maximum context length of "
                f"{max_model_len} tokens can hold (at most {chars_per_token} characters per token)",
                param=field,
            )

    async def begin(self, request: GenerationRequest) -> tuple[dict, SamplingParams]:
        """What every generation request checks first: the model it names, then its
        sampling parameters against the model's limits. (info, params)."""
        log_unknown_fields(request)
        await self.check_model(request.model)
        info = await self.model_info()
        check_task(info, "generate")
        return info, sampling_params(request, info)

    async def pool(
        self, request, prompts: list[Prompt], params: SamplingParams, request_ids: list[str],
        admission: Admission | None, field: str,
    ) -> list[RequestOutput]:  # fmt: skip
        """The finished results of pooling requests (one per prompt, nothing generated):
        their prompts are their work against the replica's admission; an engine error is
        the client's error naming `field`."""
        if admission is not None:
            admission.reserve_sequences(len(prompts), 1, field)
            num_prompt = _num_prompt_tokens(prompts)
            admission.reserve_work(num_prompt, num_prompt, params.priority)
        try:
            return await self._generate_outputs(prompts, params, request_ids, self.lora_of(request))
        except Exception as exc:
            raise to_openai_error(exc, {"prompt_token_ids": field, "prompt": field}) from exc

    def reserve(
        self, admission: Admission | None, request: GenerationRequest, num_prompts: int,
        params: SamplingParams,
    ) -> None:  # fmt: skip
        """The request's sequences (prompts x best_of) against the replica's limit (an
        overload names the field that set their number), and its priority within what its
        API key allows."""
        if admission is not None:
            field = "prompt" if num_prompts > 1 else _width_field(request)
            admission.reserve_sequences(num_prompts, params.best_of, field)
            params.priority = admission.priority_of(request.priority)
            request._admission = admission

    def reserve_work(self, request: GenerationRequest, prompts: list[Prompt], params: SamplingParams) -> None:
        """The tokenized request's work against the replica's queue (deployments/admission.py):
        its prompt tokens, plus the most tokens each sequence may generate."""
        admission = request._admission
        if admission is None:
            return
        max_model_len = self._info["max_model_len"] if self._info is not None else 0
        num_prompt = _num_prompt_tokens(prompts)
        num_new = sum(params.max_tokens or max(0, max_model_len - len(p.token_ids)) for p in prompts)
        admission.reserve_work(num_prompt, num_prompt + num_new * params.best_of, params.priority)

    def plan(
        self, request: GenerationRequest, prompts: list[Prompt], params: SamplingParams, response_id: str,
        tools: str | None = None, thinking: bool = False,
    ) -> Plan:  # fmt: skip
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        lora_name = self.lora_of(request).get("lora_name")
        return Plan(request, prompts, params, response_id, request_ids, lora_name, tools, thinking)

    @staticmethod
    def check_fits(token_ids: list[int], max_tokens: int | None, info: dict, prompt_field: str, max_field: str) -> None:
        """The prompt's token ids are in the vocabulary, and prompt + max_tokens fit the
        model's context; else a 400 naming `prompt_field` or `max_field`."""
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

    # ---------------------------------------------------------------- model info, health

    async def model_info(self) -> dict:
        if self._info is None:
            try:
                self._info = await self.client.model_info()
            except OpenAIError:
                raise  # an answer of its own (engine_starting)
            except Exception as exc:
                logger.warning("engine model_info failed: %r", exc)
                raise engine_unavailable("the engine is not available") from exc
        return self._info

    async def is_healthy(self) -> bool:
        try:
            await asyncio.wait_for(self.client.model_info(), HEALTH_TIMEOUT_S)
        except OpenAIError:
            raise  # not healthy, and why (engine_starting): /health answers it
        except Exception as exc:
            logger.warning("health check failed: %r", exc)
            return False
        return True

    async def models(self) -> ModelList:
        """The base model, then each LoRA adapter (its `parent` the base model, `root` its directory)."""
        loras = await self.lora_adapters()
        return ModelList(data=[await self._model_card()] + [await self._model_card(n, p) for n, p in loras.items()])

    async def model(self, name: str) -> ModelCard:
        await self.check_model(name)
        path = None if name == self.served_model_name else (await self.lora_adapters())[name]
        return await self._model_card(name, path)

    async def _model_card(self, lora_name: str | None = None, lora_path: str | None = None) -> ModelCard:
        info = await self.model_info()
        if lora_name is None or lora_name == self.served_model_name:
            return ModelCard(id=self.served_model_name, max_model_len=info.get("max_model_len"))
        return ModelCard(id=lora_name, max_model_len=info.get("max_model_len"), parent=self.served_model_name,
                         root=lora_path)  # fmt: skip

    async def lora_adapters(self) -> dict[str, str]:
        """The engine's LoRA adapters (name -> directory); none from a client without them."""
        adapters = getattr(self.client, "lora_adapters", None)
        return await adapters() if adapters is not None else {}

    async def check_model(self, name: str | None) -> None:
        """`model` names the served model, one of its LoRA adapters, or nothing (the base)."""
        if name is None or name == self.served_model_name:
            return
        loras = await self.lora_adapters()
        if name in loras:
            return
        also = f" and the LoRA adapters {', '.join(repr(n) for n in sorted(loras))}" if loras else ""
        raise OpenAIError(
            404,
            f"the model {name!r} does not exist; this server serves {self.served_model_name!r}{also}",
            param="model",
            code="model_not_found",
        )

    def model_name(self, request: GenerationRequest) -> str:
        """The name a response gives (the adapter's, when the request ran on one)."""
        return request.model if request.model is not None else self.served_model_name

    def lora_of(self, request: GenerationRequest) -> dict:
        """The engine client's keyword for the request's LoRA adapter ({} for the base model)."""
        name = request.model
        return {} if name is None or name == self.served_model_name else {"lora_name": name}

    # ---------------------------------------------------------------- the two answers

    async def generate_body(
        self, request: GenerationRequest, prompts: list[Prompt], params: SamplingParams,
        request_ids: list[str],
    ) -> list[RequestOutput]:  # fmt: skip
        """The finished results of a non-streamed request; an engine error is the client's
        error naming the field it wrote."""
        self.reserve_work(request, prompts, params)
        try:
            return await self._generate_outputs(prompts, params, request_ids, self.lora_of(request))
        except Exception as exc:
            raise to_openai_error(exc, engine_renames(request)) from exc

    async def open_stream(
        self, request: GenerationRequest, prompts: list[Prompt], params: SamplingParams,
        request_ids: list[str],
    ) -> tuple[tuple[int, RequestOutput], AsyncIterator[tuple[int, RequestOutput]]]:  # fmt: skip
        """The first output and the rest of a streamed request: the first is awaited before
        any byte is sent, so a request the engine rejects is an HTTP error, not an error
        event inside a 200 stream."""
        self.reserve_work(request, prompts, params)
        outputs = self._stream_outputs(prompts, params, request_ids, self.lora_of(request))
        try:
            return await anext(outputs), outputs
        except BaseException as exc:
            await outputs.aclose()
            if isinstance(exc, StopAsyncIteration):
                raise internal_error() from None
            if isinstance(exc, Exception):
                raise to_openai_error(exc, engine_renames(request)) from exc
            raise

    async def stream_events(
        self,
        request: GenerationRequest,
        prompts: list[Prompt],
        first: tuple[int, RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        to_choice: ToChoice,
        chunk,
        preamble: Iterable[str] = (),
    ) -> AsyncIterator[str]:
        """The SSE body both routes share: the preamble, one event per engine output (one
        request's step, or several steps a slow client had not read yet), the usage event
        when asked, then [DONE]; an engine failure mid-stream becomes an error event.

        Events that are ready together leave as one chunk (one body message for Serve's
        proxy to relay): the preamble with the first event, and the last event with the
        usage event and [DONE]."""
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        progress: dict[int, ChoiceProgress] = {}  # by choice index across prompts
        cached: dict[int, int] = {}  # prefix-cache hits by prompt
        num_unfinished = len(prompts)

        def event(index: int, result: RequestOutput) -> str:
            nonlocal num_unfinished
            num_unfinished -= result.finished
            cached[index] = max(cached.get(index, 0), result.num_cached_tokens)
            states = (progress.setdefault(index * request.n + out.index, ChoiceProgress()) for out in result.outputs)
            rows = [to_choice(index, out, state) for out, state in zip(result.outputs, states)]
            if all(isinstance(row, str) for row in rows):
                return chunk(rows, None) if rows else ""
            rows = [[row] if isinstance(row, str) else row for row in rows]
            depth = max(len(row) for row in rows)
            return "".join(chunk([row[k] for row in rows if k < len(row)], None) for k in range(depth))

        def end() -> str:
            if not include_usage:
                return SSE_DONE
            num_cached = sum(cached.values()) if self.enable_prompt_tokens_details else None
            num_completion = sum(state.num_tokens for state in progress.values())
            return chunk([], UsageInfo.of(_num_prompt_tokens(prompts), num_completion, num_cached)) + SSE_DONE

        body = "".join(preamble)
        try:
            body += event(*first)
            if num_unfinished:
                if body:
                    yield body
                body = ""
                async for index, result in outputs:
                    body = event(index, result)
                    if not num_unfinished:
                        break
                    if body:
                        yield body
                    body = ""
            yield body + end()
        except Exception as exc:
            yield body + sse_event(ErrorResponse(error=to_openai_error(exc, engine_renames(request)).info)) + SSE_DONE
        finally:
            await outputs.aclose()

    def usage(self, prompts: list[Prompt], results: list[RequestOutput]) -> UsageInfo:
        num_completion = sum(len(out.token_ids) for result in results for out in result.outputs)
        num_cached = sum(r.num_cached_tokens for r in results) if self.enable_prompt_tokens_details else None
        return UsageInfo.of(_num_prompt_tokens(prompts), num_completion, num_cached)

    # ---------------------------------------------------------------- engine requests

    async def _generate_outputs(
        self, prompts: list[Prompt], params: SamplingParams, request_ids: list[str], lora: dict
    ) -> list[RequestOutput]:
        """One engine request per prompt, concurrently; all aborted if any fails or we are cancelled."""
        tasks = [
            asyncio.ensure_future(self.client.generate(prompt.token_ids, params, request_id, **lora))
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
        self, prompts: list[Prompt], params: SamplingParams, request_ids: list[str], lora: dict
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) from all prompts' streams as they come.

        One prompt is read directly (the client's buffer coalesces what a slow reader has
        not read yet); several are pumped by a task each into one bounded queue. When this
        generator ends (done, error, closed or cancelled) every request not seen finished
        is aborted.
        """
        unfinished = set(request_ids)
        if len(prompts) == 1:
            stream = self.client.generate_stream(prompts[0].token_ids, params, request_ids[0], **lora)
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

        async def pump(index: int, prompt: Prompt, request_id: str) -> None:
            try:
                async for result in self.client.generate_stream(prompt.token_ids, params, request_id, **lora):
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


# ---------------------------------------------------------------- request checks

def log_unknown_fields(request: GenerationRequest) -> None:
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


def max_chars_per_token(tokenizer) -> int | None:
    """Most characters of text one token can stand for: the vocabulary's longest token
    (byte-level tokens spell a byte per character, SentencePiece pieces a character per
    character), times what the normalizer may merge; None when the normalizer may drop text
    or the tokenizer cannot say."""
    try:
        longest = max(len(token) for token in tokenizer.get_vocab())
        normalizer = json.loads(tokenizer.backend_tokenizer.to_str()).get("normalizer")
    except Exception:
        return None
    factor = 1
    for part in _normalizer_parts(normalizer):
        merge = _BOUNDED_NORMALIZERS.get(part.get("type"))
        if part.get("type") == "Replace":  # "▁" for " ": never shorter (a regex may match anything)
            pattern = part.get("pattern", {}).get("String")
            merge = 1 if pattern is not None and len(part.get("content", "")) >= len(pattern) else None
        if merge is None:
            return None
        factor *= merge
    return longest * factor


def _normalizer_parts(normalizer: dict | None) -> list[dict]:
    if normalizer is None:
        return []
    if normalizer.get("type") == "Sequence":
        return [part for n in normalizer.get("normalizers", []) for part in _normalizer_parts(n)]
    return [normalizer]


def _width_field(request: GenerationRequest) -> str:
    """The field that set how many sequences each prompt starts."""
    return "best_of" if request.best_of is not None else "n"


def sampling_params(request: GenerationRequest, info: dict) -> SamplingParams:
    try:
        return to_sampling_params(request, int(info.get("max_logprobs", 0)))
    except SamplingParamsError as exc:
        raise bad_request(str(exc)) from None


def _check_served(result: RequestOutput) -> None:
    if result.error is not None:  # the engine ignored the request (a ValueError: answered 400)
        raise ValueError(f"prompt: {result.error}")


def check_task(info: dict, task: str) -> None:
    """A route of `task` on a model served for another: a 400 naming the served task."""
    served = info.get("task", "generate")
    if served != task:
        raise bad_request(
            f"model: this model is served for the {served} task and does not answer {task} routes "
            f"(serve it with task: {task})",
            param="model",
        )


def _num_prompt_tokens(prompts: list[Prompt]) -> int:
    return sum(len(p.token_ids) for p in prompts)


# ---------------------------------------------------------------- streamed choices, as pydantic writes them

_UNFINISHED = '"finish_reason":null,"stop_reason":null}'


def reasons_json(finish_reason: str | None, stop_reason: int | str | None) -> str:
    """The closing `"finish_reason":..,"stop_reason":..}` of a streamed choice."""
    if finish_reason is None and stop_reason is None:  # every event but a choice's last
        return _UNFINISHED
    return f'"finish_reason":{json_value(finish_reason)},"stop_reason":{json_value(stop_reason)}}}'
