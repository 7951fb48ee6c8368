"""The engine's front end in the serving process: requests in, detokenized outputs out.

    generate / generate_stream ──add_request──> EngineCore (the SchedulerActor, or an
         ▲                                       in-process engine in tests)
         │ one DeltaBuffer per request               │ one batch of StepOutputs per step
         └──── OutputProcessor (text, stop strings) <┘ (the pump: one task for all requests)

Every call is one incarnation: the engine knows it as `<request id>@<n>`, so a request id
reused right after its previous call ended or was aborted never receives the old call's
steps still in flight (they name an id nobody reads any more and are dropped).

Every reader ends: with its last output, with an exception, or, aborted through
`abort` (the handle API) while it waits, with a final output whose unfinished choices say
finish_reason "abort". When the engine dies (its process, or its step loop) every waiting
reader and every later call gets `EngineUnavailable` (HTTP: 503 + Retry-After) until the
replica is replaced.

A stop string found by the processor is sent back as `stop_sequences` at once. A slow
reader never slows the pump: its buffer holds one item and coalesces the steps it has not
read yet into it (`merge_deltas`), so memory grows only with the unread tokens. With a
`stream_interval` of N tokens, a stream's reader wakes once per N tokens (the first token
and the end at once), so each delta crosses the path to the client with up to N tokens.
With a `stream_batching_interval_ms` of T, a stream's reads follow a schedule of one per
T ms (the first token, a finish and an error at once), so the events per stream stay
bounded whatever the step rate:

    steps   |t1 |t2 |t3 |t4 |t5 |t6 end
    reader  t1 ........ t2-t4 ..... t5-t6,end      (T = 3 steps; the end never waits)

The schedule is anchored to when each read was due, not to when the reader got to it: a
reader that wakes late does not push its next read back (the gap between events stays T
plus the reader's jitter, not T plus its lateness); one later than a whole interval skips
the slots it missed, it never reads twice in a row to catch up. A token that arrives after
its read was due wakes the reader at once and starts the schedule again from there.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
from collections.abc import AsyncIterator
from typing import Protocol

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.output_processor import OutputKind, OutputProcessor, merge_deltas
from rayserve_paged.engine.outputs import RequestOutput, StepOutput

logger = logging.getLogger(__name__)

# the app's default stream_batching_interval_ms (docs/benchmarks/06-serving.md, 6d measured it)
STREAM_BATCHING_INTERVAL_MS = 50.0


class RequestFailed(ValueError):
    """The engine could not serve the request as given (e.g. it can never fit)."""


class EngineUnavailable(RuntimeError):
    """The engine of this replica is gone (its process died or its step loop failed):
    retry later, when the replica has been replaced (HTTP: 503 + Retry-After)."""


class EngineCore(Protocol):
    async def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        lora_name: str | None = None,
    ) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def stop_sequences(self, request_id: str, stops: list[tuple[int, str]]) -> None: ...

    def outputs(self) -> AsyncIterator[list[StepOutput]]:
        """One batch per step, for every request, until the engine fails (raises)."""
        ...


class DeltaBuffer:
    """At most one pending item: a new delta merges into an unread one.

    With `stream_interval` N > 1 a reader is woken only once some choice has N unread
    tokens, a choice or the request finishes, or it fails; the first output (the first
    token) wakes it at once. With `batching_interval_s` T > 0 reads are due on a schedule
    of one per T seconds: the read after one that was due at D is due at D + T, or, for a
    reader that read only after that, at the first D + kT past its read (a skipped slot is
    not made up: never two reads in a row to catch up). An item that arrives before its
    read is due waits for a timer, except a finish or a failure, which wake the reader at
    once; one that arrives after wakes it at once, and the schedule restarts from then.
    Fewer, larger items then cross the path to the client.

        due    D ........... D+T ........... D+2T       a reader that wakes late (x, x')
        read    D+x ........... D+T+x' .......          does not move the next due time
    """

    def __init__(self, stream_interval: int = 1, batching_interval_s: float = 0.0) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._interval = stream_interval
        self._batching_interval_s = batching_interval_s
        self._min_tokens = 1  # the first output is never held
        self._next_due = 0.0  # loop time before which only an end wakes the reader
        self._woken_due = 0.0  # when the read now woken (or waited for) was due: the schedule
        self._timer: asyncio.TimerHandle | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException) or self._item is None:
            self._item = item
        elif isinstance(self._item, RequestOutput):
            self._item = merge_deltas(self._item, item)
        if self._ready.is_set():
            return
        if self._timer is not None:  # due soon anyway; only an end goes before
            if _is_end(self._item):
                self._wake()
            return
        if self._interval > 1 and not _is_due(self._item, self._min_tokens):
            return
        if self._batching_interval_s:
            loop = asyncio.get_running_loop()
            now = loop.time()
            if now < self._next_due and not _is_end(self._item):
                self._woken_due = self._next_due
                self._timer = loop.call_at(self._next_due, self._ready.set)
                return
            self._woken_due = now
        self._wake()

    def _wake(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        self._timer = None  # fired (or cancelled by the end that woke this read)
        if isinstance(item, BaseException):
            raise item
        self._min_tokens = self._interval
        if self._batching_interval_s:
            self._next_due = _next_slot(self._woken_due, self._batching_interval_s, asyncio.get_running_loop().time())
        return item


def _next_slot(due: float, interval: float, now: float) -> float:
    """The first due + k * interval (k >= 1) later than `now`."""
    if due + interval > now:
        return due + interval
    return due + (math.floor((now - due) / interval) + 1) * interval


def _is_end(item: RequestOutput | BaseException) -> bool:
    return isinstance(item, BaseException) or item.finished or item.error is not None


def _is_due(item: RequestOutput | BaseException, min_tokens: int) -> bool:
    if _is_end(item):
        return True
    return any(c.finish_reason is not None or len(c.token_ids) >= min_tokens for c in item.outputs)


class EngineFrontend:
    def __init__(
        self, core: EngineCore, tokenizer, stream_interval: int = 1, stream_batching_interval_ms: float = 0.0
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 (got {stream_interval})")
        if not stream_batching_interval_ms >= 0:
            raise ValueError(f"stream_batching_interval_ms must be >= 0 (got {stream_batching_interval_ms})")
        self.core = core
        self.stream_interval = stream_interval
        self.stream_batching_interval_s = stream_batching_interval_ms / 1000
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self.failure: BaseException | None = None
        # by the engine's id of a call (`<request id>@<n>`): requests the engine may still run
        self._buffers: dict[str, DeltaBuffer] = {}
        self._live: dict[str, str] = {}  # the caller's request id -> the engine's id of its call
        self._incarnations = itertools.count()
        self._pump: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, prompt: str | None = None,
        lora_name: str | None = None,
    ) -> RequestOutput:
        """The cumulative result, once finished."""
        last = None
        stream = self.generate_stream(prompt_token_ids, params, request_id, prompt, OutputKind.FINAL, lora_name)
        async for last in stream:
            pass
        return last

    async def generate_stream(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        kind: OutputKind = OutputKind.DELTA,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas: per step (or per several, for a slow reader) what is new; the last has
        finished=True. Closing the iterator early aborts the request. `lora_name`: the
        registered LoRA adapter it runs on (None: the base model)."""
        self._start_pump()
        if self.failure is not None:
            raise EngineUnavailable(f"the engine is unavailable: {self.failure!r}")
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        engine_id = f"{request_id}@{next(self._incarnations)}"
        self._live[request_id] = engine_id
        buffer = self._buffers[engine_id] = (
            DeltaBuffer(self.stream_interval, self.stream_batching_interval_s)
            if kind is OutputKind.DELTA
            else DeltaBuffer()
        )
        self.processor.add_request(engine_id, prompt, prompt_token_ids, params, kind, output_id=request_id)
        finished = False
        try:
            if lora_name is None:
                await self.core.add_request(engine_id, prompt, prompt_token_ids, params)
            else:
                await self.core.add_request(engine_id, prompt, prompt_token_ids, params, lora_name)
            if engine_id not in self._buffers:  # aborted while it was being added
                self.detached(self.core.abort(engine_id))
            while not finished:
                out = await buffer.get()
                if out.error is not None:
                    finished = True
                    # the engine's errors name their field ("model: ..." for a failed adapter)
                    raise RequestFailed(out.error if out.error.startswith("model: ") else f"prompt: {out.error}")
                finished = out.finished
                yield out
        finally:
            self.processor.abort_request(engine_id)
            if self._live.get(request_id) == engine_id:
                del self._live[request_id]
            is_live = self._buffers.pop(engine_id, None) is not None
            if is_live and not finished:  # the caller went away (or failed): free its blocks now
                self.detached(self.core.abort(engine_id))

    async def abort(self, request_id: str) -> None:
        """Abort a running request (once: a request already ended or aborted is left alone).
        Its reader, if one waits, gets a final output (finish_reason "abort")."""
        engine_id = self._live.pop(request_id, None)
        if engine_id is None:
            return
        final = self.processor.abort_request(engine_id)
        buffer = self._buffers.pop(engine_id, None)
        if buffer is not None:
            buffer.put(final)
            await self.core.abort(engine_id)

    def detached(self, coro) -> asyncio.Task:
        """Run `coro` outside the calling request's context (Serve cancels the Ray calls of a
        cancelled request; the output pump, aborts and stops must outlive it)."""
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _start_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = self.detached(self._pump_outputs())

    async def _pump_outputs(self) -> None:
        try:
            async for batch in self.core.outputs():
                self.dispatch(batch)
        except Exception as e:  # the engine died: fail everyone waiting, at once
            logger.error("engine output stream failed: %r", e)
            self.failure = e
            for buffer in self._buffers.values():
                buffer.put(EngineUnavailable(f"the engine failed: {e!r}"))

    def dispatch(self, batch: list[StepOutput]) -> None:
        for step_output in batch:
            output, stop = self.processor.process(step_output)
            if stop is not None:
                self.detached(self.core.stop_sequences(stop.request_id, stop.stops))
            if output is not None:
                buffer = self._buffers.get(step_output.request_id)
                if buffer is not None:
                    buffer.put(output)

    async def close(self) -> None:
        if self._pump is not None:
            await cancel_and_wait(self._pump)
            self._pump = None


async def cancel_and_wait(task: asyncio.Task) -> None:
    """Cancel `task` and return once it has ended."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
