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
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1 (got {self.disable_by_batch_size})")


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
