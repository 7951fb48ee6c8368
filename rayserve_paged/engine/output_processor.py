"""Turns the engine's per-step deltas (token ids) into what callers read: text, stop strings,
and either deltas (streams) or the cumulative result (built once, where asked).

It runs in the process that consumes the outputs (the LLMServer replica, or `LLM`'s own),
so the step loop never detokenizes. A stop string found here ends the choice at once: the
processor returns a `StopRequest` that its owner sends to the engine (which frees the
sequence's blocks); tokens the engine produced for that choice meanwhile are dropped.

    choice text   [.... sent ....|.. held back ..]     held back: a possible stop-string
                                 ^num_sent_chars        prefix (max stop length - 1 chars)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.detokenizer import DecodeState, Detokenizer
from rayserve_paged.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepOutput


class OutputKind(enum.Enum):
    DELTA = "delta"  # every step: what is new (streams)
    FINAL = "final"  # once, finished: the whole result


@dataclass(slots=True)
class StopRequest:
    """Choices a stop string ended: (choice index, the stop string)."""

    request_id: str
    stops: list[tuple[int, str]]


@dataclass(slots=True)
class _Choice:
    index: int
    decode: DecodeState | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    is_finish_sent: bool = False


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    holdback: int
    choices: dict[int, _Choice] = field(default_factory=dict)
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # from the engine's first output
    pooled: list[float] | None = None  # a pooling request's vector
    metrics: RequestMetrics | None = None
    output_id: str = ""  # the request id its outputs carry (the caller's, when it differs)

    @property
    def num_choices(self) -> int:
        """Choices the engine reports: beam search its n best, sampling all best_of."""
        return self.params.n if self.params.use_beam_search else self.params.best_of

    @property
    def is_final_only(self) -> bool:
        """Beam search reorders beams and best_of > n picks the n at the end: no deltas."""
        return self.kind is OutputKind.FINAL or self.params.use_beam_search or self.params.best_of > self.params.n


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.requests: dict[str, _Request] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kind: OutputKind = OutputKind.FINAL,
        output_id: str | None = None,
    ) -> None:
        holdback = 0 if not params.stop or params.include_stop_str_in_output else max(map(len, params.stop)) - 1
        self.requests[request_id] = _Request(
            request_id, prompt, prompt_token_ids, params, kind, holdback, output_id=output_id or request_id
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget the request; returns its final output (None: not here): every choice not
        yet finished ends with finish_reason "abort", with the text it has so far."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for index in range(request.num_choices):
            choice = request.choices.get(index)
            if choice is None:
                choice = request.choices[index] = _Choice(index, None)
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
        if request.is_final_only:
            return _cumulative(request, True)
        return _delta(request, True)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def process(self, out: StepOutput) -> tuple[RequestOutput | None, StopRequest | None]:
        """The caller's output for this step (None: nothing to say yet), and the choices a
        stop string ended, for the engine. A finished request is forgotten here."""
        request = self.requests.get(out.request_id)
        if request is None:  # aborted, or already ended by a stop string
            return None, None
        if out.error is not None:
            del self.requests[out.request_id]
            return _errored(request, out), None
        if out.num_cached_tokens:
            request.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            request.prompt_logprobs = out.prompt_logprobs
        if out.pooled is not None:
            request.pooled = out.pooled
        stops = [stop for delta in out.outputs if (stop := self._apply(request, delta)) is not None]
        is_finished = out.finished or (
            len(request.choices) == request.num_choices and all(c.finish_reason for c in request.choices.values())
        )
        if out.metrics is not None:
            request.metrics = out.metrics
        if is_finished:
            del self.requests[out.request_id]
        stop = StopRequest(out.request_id, stops) if stops else None
        if request.is_final_only:
            return (_cumulative(request, is_finished) if is_finished else None), stop
        return _delta(request, is_finished), stop

    def _apply(self, request: _Request, delta) -> tuple[int, str] | None:
        """One choice's step; (choice index, stop string) when a stop string ended it here."""
        choice = request.choices.get(delta.index)
        if choice is None:
            choice = request.choices[delta.index] = self._new_choice(request, delta.index)
        if choice.finish_reason is not None:  # ended here by a stop string: later tokens are dropped
            return None
        if request.params.use_beam_search:
            self._apply_beam(choice, request.params, delta)
        elif (stop := self._apply_tokens(choice, request.params, delta)) is not None:
            return stop
        # what the engine says of the choice after this step: its logprob, and its end
        choice.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        return None

    def _new_choice(self, request: _Request, index: int) -> _Choice:
        params = request.params
        decode = None  # beam search decodes whole hypotheses
        if not params.use_beam_search:
            decode = self.detokenizer.start(request.prompt_token_ids, params.skip_special_tokens)
        return _Choice(index, decode, logprobs=[] if params.logprobs is not None else None)

    def _apply_beam(self, choice: _Choice, params: SamplingParams, delta) -> None:
        """Beam search: a whole hypothesis, once (beams reorder until the end); decoded in
        one go, and cut where the engine ended it at a stop string."""
        choice.token_ids = list(delta.token_ids)
        choice.logprobs = list(delta.top_logprobs) if choice.logprobs is not None and delta.top_logprobs else None
        choice.text = self.detokenizer.decode(choice.token_ids, params.skip_special_tokens)
        if isinstance(delta.stop_reason, str) and delta.stop_reason in params.stop:
            _cut_at_stop(choice, params, delta.stop_reason)

    def _apply_tokens(self, choice: _Choice, params: SamplingParams, delta) -> tuple[int, str] | None:
        """Sampling: the step's new tokens, decoded one by one; the first stop string that
        ends in the new text ends the choice there (the rest of the step is dropped), and
        is returned with the choice's index."""
        for i, token_id in enumerate(delta.token_ids):
            choice.token_ids.append(token_id)
            if choice.logprobs is not None and delta.top_logprobs is not None:
                choice.logprobs.append(delta.top_logprobs[i])
            before = len(choice.text)
            new_text = self.detokenizer.decode_next(choice.decode, token_id, params.skip_special_tokens)
            if not new_text:
                continue
            choice.text += new_text
            if params.stop and (stop := _find_stop(choice, params, before)) is not None:
                choice.cumulative_logprob = delta.cumulative_logprob
                return choice.index, stop
        return None


def find_stop(text: str, stops: list[str], before: int) -> tuple[str, int] | None:
    """The first of `stops` that ends in text[before:] (the new text), and where it starts."""
    for stop in stops:
        at = text.find(stop, max(0, before - len(stop) + 1))
        if at != -1:
            return stop, at
    return None


def _find_stop(choice: _Choice, params: SamplingParams, before: int) -> str | None:
    """Cut the text at the first stop string that ends in the new text; end the choice."""
    found = find_stop(choice.text, params.stop, before)
    if found is None:
        return None
    _cut_at_stop(choice, params, *found)
    return found[0]


def _cut_at_stop(choice: _Choice, params: SamplingParams, stop: str, at: int | None = None) -> None:
    """End the choice at the stop string (its first occurrence unless `at` says where)."""
    at = choice.text.find(stop) if at is None else at
    if at != -1:
        choice.text = choice.text[: at + len(stop) if params.include_stop_str_in_output else at]
    choice.finish_reason, choice.stop_reason = "stop", stop


def _delta(request: _Request, is_finished: bool) -> RequestOutput | None:
    outputs = []
    for choice in sorted(request.choices.values(), key=lambda c: c.index):
        is_finishing = choice.finish_reason is not None and not choice.is_finish_sent
        end = len(choice.text) if choice.finish_reason is not None else len(choice.text) - request.holdback
        text = choice.text[choice.num_sent_chars : end] if end > choice.num_sent_chars else ""
        token_ids = choice.token_ids[choice.num_sent_tokens :]
        if not text and not token_ids and not is_finishing:
            continue
        logprobs = choice.logprobs[choice.num_sent_tokens :] if choice.logprobs is not None else None
        choice.num_sent_chars = max(choice.num_sent_chars, end)
        choice.num_sent_tokens = len(choice.token_ids)
        choice.is_finish_sent = choice.finish_reason is not None
        outputs.append(
            CompletionOutput(
                index=choice.index,
                text=text,
                token_ids=token_ids,
                cumulative_logprob=choice.cumulative_logprob,
                logprobs=logprobs,
                finish_reason=choice.finish_reason if is_finishing else None,
                stop_reason=choice.stop_reason if is_finishing else None,
            )
        )
    if not outputs and not is_finished:
        return None
    return _output(request, outputs, is_finished)


def _cumulative(request: _Request, is_finished: bool) -> RequestOutput:
    choices = sorted(request.choices.values(), key=lambda c: c.index)
    params = request.params
    if not params.use_beam_search and params.best_of > params.n:
        choices = sorted(choices, key=lambda c: c.cumulative_logprob, reverse=True)[: params.n]
    outputs = [
        CompletionOutput(
            index=i,
            text=c.text,
            token_ids=c.token_ids,
            cumulative_logprob=c.cumulative_logprob,
            logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for i, c in enumerate(choices[: params.n])
    ]
    return _output(request, outputs, is_finished)


def _output(request: _Request, outputs: list[CompletionOutput], is_finished: bool) -> RequestOutput:
    return RequestOutput(
        request_id=request.output_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=outputs,
        finished=is_finished,
        metrics=request.metrics,
        num_cached_tokens=request.num_cached_tokens,
        prompt_logprobs=request.prompt_logprobs,
        pooled=request.pooled,
    )


def _errored(request: _Request, out: StepOutput) -> RequestOutput:
    return RequestOutput(
        request_id=request.output_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[],
        finished=True,
        metrics=out.metrics,
        error=out.error,
    )


def merge_deltas(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One delta saying what two consecutive deltas of a request say (a slow reader's
    buffer coalesces instead of growing by one item per step)."""
    by_index = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids = prev.token_ids + c.token_ids
        if prev.logprobs is not None and c.logprobs is not None:
            prev.logprobs = prev.logprobs + c.logprobs
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
    newer.outputs = sorted(by_index.values(), key=lambda c: c.index)
    return newer
