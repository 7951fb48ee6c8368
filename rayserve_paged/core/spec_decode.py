"""Speculative decoding, the scheduler's half: n-gram (prompt lookup) drafts, and the
lookahead slots of a draft model's drafts.

A decoding sequence with k drafts is scheduled as k + 1 query tokens over its cached
context (its last token, then the drafts); the model's logits at those k + 1 positions
verify the drafts (models/sampler.py `Sampler.verify`): the accepted ones and one more
token join the sequence, the rest are rolled back (`BlockManager.roll_back`).

    tokens     [ ... cached ... | t ][ d1  d2  d3 ]        k = 3 drafts
    query                        t    d1  d2  d3           4 query tokens, one row
    logits                       p0   p1  p2  p3           p_j: the next token after d_j
    accepted                     d1 d2 | x                 d3 rejected: x drawn from p2's residual

Pure Python: the n-gram proposer reads only the sequence's own token ids. With a draft
model (method "draft_model") the scheduler decides only how many drafts a row gets (k, and
its lookahead slots); the row's k draft tokens go out as DRAFT_PLACEHOLDER and the worker
fills them in at the start of the step, from its draft model (worker/draft_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
DRAFT_PLACEHOLDER = 0  # a draft token the worker's draft model proposes (method draft_model)


@dataclass(slots=True)
class SpeculativeConfig:
    """The scheduler's copy of the engine's speculative_config."""

    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # no drafts in a step whose running batch holds at least this many sequences: 32, measured
    # on the embedded SmolLM2 (docs/benchmarks/27-speculative.md): n-gram drafts still gain
    # on a high-overlap workload at 32 concurrent, while on ordinary chat they lose at every
    # batch size and most at 32 (0.67x), so 32 concurrent streams run without them
    disable_by_batch_size: int = 32
    method: str = NGRAM  # NGRAM: drafts looked up here; DRAFT_MODEL: proposed by the worker
    # a sequence whose last WINDOW verification steps kept fewer drafts than this on average
    # drafts no more for PAUSE decode steps, doubled while it stays low (DraftRecord): a
    # verification step costs about two plain decodes on the CPU (docs/benchmarks/27), so
    # fewer than one kept draft per step loses; 0: never paused
    min_accepted_per_step: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in (NGRAM, DRAFT_MODEL):
            raise ValueError(f"speculative method must be {NGRAM!r} or {DRAFT_MODEL!r} (got {self.method!r})")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 (got {self.num_speculative_tokens})")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max (got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max})"
            )
        if self.min_accepted_per_step < 0:
            raise ValueError(f"min_accepted_per_step must be >= 0 (got {self.min_accepted_per_step})")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1 (got {self.disable_by_batch_size})")


WINDOW = 4  # verification steps per judgement
PAUSE = 16  # decode steps without drafts after a low window; doubled per low window in a row
MAX_PAUSE = 256


class DraftRecord:
    """One sequence's recent acceptance: whether it drafts this step (`drafts`), and what its
    verification steps kept (`verified`). A window of WINDOW verification steps that kept
    fewer than `min_accepted` drafts per step on average pauses the sequence's drafts for
    PAUSE decode steps, then 2 x PAUSE after another low window, up to MAX_PAUSE; a window
    at or above it ends the doubling. Chat that seldom repeats itself thus stops paying for
    drafts, and a sequence that turns repetitive later drafts again after its pause."""

    __slots__ = ("steps", "accepted", "pause", "next_pause")

    def __init__(self) -> None:
        self.steps = 0  # verification steps in the window so far
        self.accepted = 0  # drafts they kept
        self.pause = 0  # decode steps left without drafts
        self.next_pause = PAUSE

    def drafts(self) -> bool:
        if self.pause:
            self.pause -= 1
            return False
        return True

    def verified(self, accepted: int, min_accepted: float) -> None:
        self.steps += 1
        self.accepted += accepted
        if self.steps < WINDOW:
            return
        if self.accepted < min_accepted * self.steps:
            self.pause = self.next_pause
            self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
        else:
            self.next_pause = PAUSE
        self.steps = self.accepted = 0


def count_positions(counts: list[int], num: int) -> None:
    """Add one to each of the first `num` draft positions' counts (drafts scheduled, or
    accepted: draft j is accepted only if drafts 0..j-1 were), growing the list as needed."""
    if len(counts) < num:
        counts.extend([0] * (num - len(counts)))
    for position in range(num):
        counts[position] += 1


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, for the largest n in [min_n, max_n] that occurs (vLLM's prompt lookup); [] when
    none does. O(len * max_n) per call, only for sequences that may draft this step."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = token_ids[length - n :]
        first = tail[0]
        # the latest match ending before the tail itself
        i = length - n - 1
        while i >= 0:
            if token_ids[i] == first and token_ids[i : i + n] == tail:
                return token_ids[i + n : i + n + k]
            i -= 1
    return []
