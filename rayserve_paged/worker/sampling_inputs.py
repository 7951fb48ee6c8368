"""Per-row sampling facts -> the sampler's `SamplingBatch`, cheaply.

A request's SamplingParams become a `RowTemplate` once, when the request arrives; the
persistent batch (worker/input_batch.py, which imports this module, never the reverse)
keeps it with the request. Each step it then only gathers, per logits row, the template
and the row's own indices (`InputBatch.sampling_batch`):

    (template, seq_id, sample_index, output_index, num_draws, history or None, num_prompt_tokens)

`sampling_batch(rows)` transposes these into columns (zip: C speed); the sparse controls
(penalties, logit_bias, min_tokens) cost a Python pass only when some row's template has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rayserve_paged.core.outputs import StepMessage
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.models.sampler import RowPenalty, SamplingBatch


@dataclass(slots=True, frozen=True, eq=False)
class RowTemplate:
    """What a request's rows share, derived once from its SamplingParams."""

    # one row's (temperature, top_k, top_p, min_p, seed, logprobs, beam_width), in
    # SamplingBatch's column order; temperature 0.0 for greedy
    columns: tuple
    num_first_draws: int  # draws on the group's first step: best_of (1 for beam search)
    penalties: tuple[float, float, float] | None  # (repetition, frequency, presence) when one is on
    logit_bias: dict[int, float] | None
    min_tokens: int  # the banned tokens are masked while a sequence has fewer output tokens
    banned_tokens: tuple[int, ...]  # EOS and stop token ids
    has_controls: bool  # penalties, logit_bias or min_tokens: a per-row look is needed


# (template, seq_id, sample_index, output_index, num_draws, history or None, num_prompt_tokens)
SamplingRow = tuple[RowTemplate, int, int, int, int, "Sequence[int] | None", int]


def row_template(params: SamplingParams, eos_token_ids: Sequence[int] = ()) -> RowTemplate:
    """Beam search samples nothing: its rows ignore penalties, logit_bias and min_tokens
    (SamplingParams refuses penalties with beam search), as before."""
    beam = params.use_beam_search
    temperature = 0.0 if params.is_greedy else params.temperature
    columns = (temperature, params.top_k, params.top_p, params.min_p, params.seed, params.logprobs,
               params.best_of if beam else 0)
    penalties = None
    if params.needs_history and not beam:
        penalties = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
    logit_bias = dict(params.logit_bias) if params.logit_bias and not beam else None
    banned = tuple(eos_token_ids) + tuple(params.stop_token_ids)
    min_tokens = params.min_tokens if banned and not beam else 0
    return RowTemplate(
        columns=columns,
        num_first_draws=1 if beam else params.best_of,
        penalties=penalties,
        logit_bias=logit_bias,
        min_tokens=min_tokens,
        banned_tokens=banned,
        has_controls=bool(penalties or logit_bias or min_tokens),
    )


def sampling_batch(
    rows: Sequence[SamplingRow], bitmask_rows: Sequence[int] = (), bitmask: torch.Tensor | None = None
) -> SamplingBatch:
    """One SamplingBatch row per entry, in order. On a group's first step a row draws
    num_draws = template.num_first_draws tokens seeded by sample indices 0, 1, ...: pass
    sample_index 0 there, the sequence's own index afterwards. `bitmask` [k, words] holds
    the token bitmasks of the constrained rows `bitmask_rows`."""
    if not rows:
        return SamplingBatch((), (), (), (), (), (), (), (), (), (), ())
    templates, seq_ids, sample_indices, output_indices, num_draws, histories, num_prompt_tokens = zip(*rows)
    temperatures, top_ks, top_ps, min_ps, seeds, logprobs, beam_widths = zip(*[t.columns for t in templates])
    penalties: dict[int, RowPenalty] = {}
    logit_bias: dict[int, dict[int, float]] = {}
    banned_tokens: dict[int, Sequence[int]] = {}
    if any(t.has_controls for t in set(templates)):
        for row, t in enumerate(templates):
            if not t.has_controls:
                continue
            if t.penalties is not None and histories[row] is not None:
                penalties[row] = RowPenalty(histories[row], num_prompt_tokens[row], *t.penalties)
            if t.logit_bias is not None:
                logit_bias[row] = t.logit_bias
            if output_indices[row] < t.min_tokens:
                banned_tokens[row] = t.banned_tokens
    return SamplingBatch(
        seq_ids, temperatures, top_ks, top_ps, min_ps, seeds, sample_indices, output_indices, num_draws,
        beam_widths, logprobs, penalties, logit_bias, banned_tokens, bitmask_rows, bitmask,
    )


def unpack_step_bitmasks(msg: StepMessage) -> torch.Tensor:
    """The step's packed bitmasks as [k, words] int32 (StepMessage.token_bitmasks)."""
    return torch.frombuffer(bytearray(msg.token_bitmasks), dtype=torch.int32).view(len(msg.bitmask_seq_ids), -1)
