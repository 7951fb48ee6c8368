"""Admission: what one LLMServer replica takes on, weighed by the work it carries. A request
waits in the engine's queue unless the estimate says it would wait too long; then, and
only then, it is shed.

    request arrives ──> a slot (max_pending_requests)        503 + Retry-After when none is free
    body validated  ──> sequences: prompts x best_of          503 + Retry-After while the budget
                        against max_pending_sequences             is spent; 400 for a request
                                                                  larger than the whole budget
    prompts encoded ──> work: the estimated queue time         503 + Retry-After (the estimate)
                        against max_queue_wait_s, and the      when it would wait longer, or
                        queued prompt tokens against           the prompt tokens are spent
                        max_queued_prompt_tokens
    answer ends     ──> slot, sequences and work back (a stream: at its last byte or the client leaving)

A slot is taken before the body is read, so a flood of requests costs no parsing; the
sequences are known only once the body is parsed (8 prompts with n=4 are 32 sequences, one
chat request with best_of=4 is 4), and are reserved before any prompt is tokenized; the
work once the prompts are tokens.

The queue-time estimate. A request's work is its prompt tokens plus the most tokens it may
generate (max_tokens, else what the context leaves) for each sequence: an upper bound, known
at admission. The replica measures how fast admitted work drains: the work of the requests
that ended, per second during which some work was admitted and unfinished (an idle replica
measures nothing). Both are in the same unit, so the overcount of a max_tokens that is
never reached cancels out: the estimate is the work ahead of a request divided by the rate
(`estimated_wait_s`). Under the `priority` policy, the work ahead of a request is that of
the requests at least as urgent (the engine admits in that order), so the least urgent are
shed first, and an urgent request is admitted while a flood of less urgent ones is shed.
Before the first measurement nothing is shed by time: the queued prompt tokens bound a cold
replica's queue.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rayserve_paged.deployments.errors import bad_request, forbidden, overloaded

DEFAULT_MAX_PENDING_REQUESTS = 2048  # per replica: what one replica's event loop holds cheaply
DEFAULT_MAX_PENDING_SEQUENCES = 4096  # per replica
DEFAULT_MAX_QUEUE_WAIT_S = 300.0  # docs/benchmarks/22-load.md: a 1,000-request burst to `make run` drains within it
DEFAULT_MAX_QUEUED_PROMPT_TOKENS = 1 << 20  # per replica: ~1M token ids queued (a few MiB of lists)
RATE_WINDOW_S = 1.0  # busy seconds per rate sample
RATE_SMOOTHING = 0.5  # weight of the newest sample

SCOPE_KEY = "rayserve_paged.admission"  # where the ASGI scope carries a request's Admission
# where the API-key middleware leaves the most urgent priority the caller's key may ask for
MIN_PRIORITY_SCOPE_KEY = "rayserve_paged.min_priority"


@dataclass(slots=True)
class AdmissionLimit:
    """Requests, sequences and work in flight in this replica, from arrival until the last
    byte of the answer (a stream included) or the client leaving; and the drain rate."""

    max_pending: int
    max_sequences: int = DEFAULT_MAX_PENDING_SEQUENCES
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    max_prompt_tokens: int = DEFAULT_MAX_QUEUED_PROMPT_TOKENS
    by_priority: bool = False  # the engine's scheduling_policy is "priority"
    clock: Callable[[], float] = time.monotonic
    num_pending: int = 0
    num_sequences: int = 0
    num_prompt_tokens: int = 0
    num_work: int = 0  # tokens of work admitted and unfinished
    work_by_priority: dict[int, int] = field(default_factory=dict)
    rate: float | None = None  # work drained per busy second; None until measured
    _busy_s: float = 0.0  # busy seconds before the current busy period
    _busy_since: float = 0.0  # start of the current busy period (while num_work > 0)
    _sample_start_s: float = 0.0  # busy seconds when the current rate sample began
    _sample_work: int = 0  # work drained in the current sample

    def can_admit(self) -> bool:
        return self.num_pending < self.max_pending

    def admit(self) -> Admission:
        self.num_pending += 1
        return Admission(self)

    def work_ahead(self, priority: int) -> int:
        """Work the engine serves before a new request of `priority` (all of it under fcfs)."""
        if not self.by_priority:
            return self.num_work
        return sum(work for p, work in self.work_by_priority.items() if p <= priority)

    def estimated_wait_s(self, priority: int = 0) -> float | None:
        """Seconds a new request of `priority` would wait for the work ahead of it; None
        before the rate is measured."""
        if self.rate is None:
            return None
        return self.work_ahead(priority) / self.rate

    def _busy_seconds(self, now: float) -> float:
        return self._busy_s + (now - self._busy_since if self.num_work else 0.0)

    def _add_work(self, work: int, priority: int) -> None:
        if not self.num_work:
            self._busy_since = self.clock()
        self.num_work += work
        self.work_by_priority[priority] = self.work_by_priority.get(priority, 0) + work

    def _drain_work(self, work: int, priority: int) -> None:
        now = self.clock()
        busy = self._busy_seconds(now)
        self._sample_work += work
        if busy - self._sample_start_s >= RATE_WINDOW_S:
            sample = self._sample_work / (busy - self._sample_start_s)
            self.rate = sample if self.rate is None else RATE_SMOOTHING * sample + (1 - RATE_SMOOTHING) * self.rate
            self._sample_start_s, self._sample_work = busy, 0
        left = self.work_by_priority[priority] - work
        if left:
            self.work_by_priority[priority] = left
        else:
            del self.work_by_priority[priority]
        self.num_work -= work
        if not self.num_work:
            self._busy_s = busy


@dataclass(slots=True)
class Admission:
    """One admitted request: its slot, the sequences and the work it reserved, and the most
    urgent priority its API key may ask for (None: any)."""

    limit: AdmissionLimit
    min_priority: int | None = None
    num_sequences: int = 0
    num_prompt_tokens: int = 0
    work: int = 0
    priority: int = 0
    is_released: bool = False

    def reserve_sequences(self, num_prompts: int, best_of: int, param: str) -> None:
        """Reserve num_prompts x best_of sequences of the budget, or refuse: a 400 naming
        `param` when the request alone is over the whole budget (retrying cannot help), a
        503 + Retry-After while other requests hold the budget."""
        num = num_prompts * best_of
        limit = self.limit
        if num > limit.max_sequences:
            raise bad_request(
                f"{param}: {num_prompts} prompt(s) x best_of {best_of} = {num} sequences; this server "
                f"admits at most {limit.max_sequences} sequences per replica (max_pending_sequences)",
                param=param,
            )
        if limit.num_sequences + num > limit.max_sequences:
            raise overloaded(
                f"the server is overloaded: {limit.num_sequences} sequences are in flight on this replica and "
                f"this request needs {num} (the limit is {limit.max_sequences}); retry later"
            )
        limit.num_sequences += num
        self.num_sequences += num

    def priority_of(self, requested: int | None) -> int:
        """The priority the request runs at: as asked (default 0), never more urgent than
        its key allows (403 naming `priority`); unset, the key's limit when that is less
        urgent than 0."""
        floor = self.min_priority
        if requested is None:
            return 0 if floor is None else max(0, floor)
        if floor is not None and requested < floor:
            raise forbidden(
                f"priority: this API key may ask for priority {floor} or higher (lower is more urgent; asked "
                f"for {requested})",
                param="priority",
            )
        return requested

    def reserve_work(self, num_prompt_tokens: int, work: int, priority: int) -> None:
        """Queue the request's work, or shed it: 503 + Retry-After (from the estimate) when
        it would wait longer than max_queue_wait_s, or its prompts would take the queued
        prompt tokens past max_queued_prompt_tokens. A request finding nothing ahead of it is
        always admitted (no request is too large to ever be served)."""
        limit = self.limit
        ahead = limit.work_ahead(priority)
        wait_s = limit.estimated_wait_s(priority)
        if ahead and wait_s is not None and wait_s > limit.max_queue_wait_s:
            raise overloaded(
                f"the server is overloaded: this request would wait about {wait_s:.0f} s in this replica's queue "
                f"(the limit is {limit.max_queue_wait_s:g} s, max_queue_wait_s); retry later",
                wait_s - limit.max_queue_wait_s,
            )
        if limit.num_prompt_tokens and limit.num_prompt_tokens + num_prompt_tokens > limit.max_prompt_tokens:
            raise overloaded(
                f"the server is overloaded: {limit.num_prompt_tokens} prompt tokens are queued on this replica and "
                f"this request has {num_prompt_tokens} (the limit is {limit.max_prompt_tokens}, "
                "max_queued_prompt_tokens); retry later",
                _drain_s(limit, limit.num_prompt_tokens + num_prompt_tokens - limit.max_prompt_tokens),
            )
        limit.num_prompt_tokens += num_prompt_tokens
        limit._add_work(work, priority)
        self.num_prompt_tokens, self.work, self.priority = num_prompt_tokens, work, priority

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            limit = self.limit
            limit.num_pending -= 1
            limit.num_sequences -= self.num_sequences
            limit.num_prompt_tokens -= self.num_prompt_tokens
            if self.work:
                limit._drain_work(self.work, self.priority)


def _drain_s(limit: AdmissionLimit, work: int) -> float | None:
    """Seconds until `work` has drained at the measured rate (None: not measured)."""
    return None if limit.rate is None else math.ceil(work / limit.rate)
