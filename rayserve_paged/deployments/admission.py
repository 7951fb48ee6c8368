"""Admission: what one LLMServer replica takes on at a time, weighed by the work it carries.

    request arrives ──> a slot (max_pending_requests)        503 + Retry-After when none is free
    body validated  ──> sequences: prompts x best_of          503 + Retry-After while the budget
                        against max_pending_sequences             is spent; 400 for a request
                                                                  larger than the whole budget
    answer ends     ──> slot and sequences back (a stream: at its last byte or the client leaving)

A slot is taken before the body is read, so a flood of requests costs no parsing; the
sequences are known only once the body is parsed (8 prompts with n=4 are 32 sequences, one
chat request with best_of=4 is 4), and are reserved before any prompt is tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayserve_paged.deployments.errors import bad_request, overloaded

DEFAULT_MAX_PENDING_REQUESTS = 256  # per replica
DEFAULT_MAX_PENDING_SEQUENCES = 1024  # per replica: 4 x the engine's default max_num_seqs

SCOPE_KEY = "rayserve_paged.admission"  # where the ASGI scope carries a request's Admission


@dataclass(slots=True)
class AdmissionLimit:
    """Requests and sequences in flight in this replica, from arrival until the last byte
    of the answer (a stream included) or the client leaving."""

    max_pending: int
    max_sequences: int = DEFAULT_MAX_PENDING_SEQUENCES
    num_pending: int = 0
    num_sequences: int = 0

    def can_admit(self) -> bool:
        return self.num_pending < self.max_pending

    def admit(self) -> Admission:
        self.num_pending += 1
        return Admission(self)


@dataclass(slots=True)
class Admission:
    """One admitted request: its slot and the sequences it reserved."""

    limit: AdmissionLimit
    num_sequences: int = 0
    is_released: bool = field(default=False)

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

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.limit.num_pending -= 1
            self.limit.num_sequences -= self.num_sequences
