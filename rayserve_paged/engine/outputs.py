"""What the engine emits per step (deltas) and what callers get back per request.

    engine.step() ──> [StepOutput]          per advanced request: only what this step added
                       │  (token ids, their top logprobs, counts, finish reasons; no text)
                       ▼
    OutputProcessor (engine/output_processor.py, in the caller's process)
                       │  detokenizes, checks stop strings, keeps each request's state
                       ▼
    RequestOutput      a delta (the new text and token ids, for streams) or, built only
                       where asked, the cumulative result (LLM.generate, handle `generate`,
                       non-streaming HTTP)

Nothing that grows with a request's history crosses a process boundary per step, and what
does (a step's StepOutputs, scheduler actor -> replica) pickles as constructor calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayserve_paged.pickling import compact_pickle


@compact_pickle
@dataclass(slots=True)
class SequenceDelta:
    """One sequence's new tokens in one step. `index` is the sequence's stable place in its
    request (choice index; for best_of > n the n kept are chosen from all best_of)."""

    index: int
    token_ids: list[int]
    top_logprobs: list[dict[int, float]] | None  # per new token: sampled token and top-k, when asked
    cumulative_logprob: float
    num_output_tokens: int  # the sequence's output tokens so far (this step's included)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@compact_pickle
@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@compact_pickle
@dataclass(slots=True)
class StepOutput:
    """One request's progress in one step. Beam search reorders its beams until the end, so
    a beam-search request emits once, finished, with its n hypotheses whole."""

    request_id: str
    outputs: list[SequenceDelta]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (first output only)
    metrics: RequestMetrics | None = None  # with the finished output only
    error: str | None = None  # set when the request could not be served (e.g. ignored)
    # with the first output of a request with prompt_logprobs: per prompt token, its
    # logprob and the top-k alternatives' (None for the first token)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    pooled: list[float] | None = None  # a pooling request's vector (with its one, finished output)


@dataclass(slots=True)
class CompletionOutput:
    """One choice: a delta (new text and tokens) in a stream, cumulative otherwise."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: sampled token and top-k alternatives
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    tool_calls: list | None = None  # LLM.chat with tools: the ToolCalls read from the text (engine/tool_calls.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request could not be served (e.g. ignored)
    num_cached_tokens: int = field(default=0)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # SamplingParams.prompt_logprobs
    pooled: list[float] | None = None  # a pooling request's vector (SamplingParams.pooling)
