"""Readable views of a scheduler step for tests: one object per scheduled group and row,
built from the step's message and records (the engine reads those directly)."""

from __future__ import annotations

from dataclasses import dataclass

from rayserve_paged.core import SamplingParams, SchedulerOutput


@dataclass(slots=True)
class SeqView:
    """One row; the message holds the same facts."""

    seq_id: int
    token_ids: list[int]  # tokens computed this step (one for a decode)
    start_pos: int  # tokens of this sequence already in the cache before the step
    block_table: list[int]  # GPU block ids covering positions [0, start_pos + len(token_ids))
    num_output_tokens: int  # output tokens after this step's tokens
    sample_index: int  # the sequence's place in its group


@dataclass(slots=True)
class GroupView:
    request_id: str
    seqs: list[SeqView]
    sampling_params: SamplingParams | None  # only with the request's first scheduled step
    num_prompt_tokens: int
    is_first_step: bool
    do_sample: bool = True


def groups(out: SchedulerOutput) -> list[GroupView]:
    """The step as one object per group and sequence, built from the message and the live
    block tables (read it before the next step changes them)."""
    msg = out.message
    new = {r.request_id: r.sampling_params for r in msg.new_requests}
    offsets = [0]
    for n in msg.num_query_tokens:
        offsets.append(offsets[-1] + n)
    views = []
    for group, first_row, num_rows, do_sample, is_first_step in out.scheduled:
        index = {s.seq_id: i for i, s in enumerate(group.seqs)}
        num_prompt = group.seqs[0].num_prompt_tokens
        seqs = []
        for row in range(first_row, first_row + num_rows):
            seq_id = msg.seq_ids[row]
            start = msg.start_positions[row]
            tokens = msg.token_ids[offsets[row] : offsets[row + 1]]
            table = list(out.block_tables.get(seq_id, [])) if out.block_tables is not None else []
            seqs.append(SeqView(seq_id, tokens, start, table, start + len(tokens) - num_prompt, index.get(seq_id, -1)))
        views.append(
            GroupView(group.request_id, seqs, new.get(group.request_id), num_prompt, is_first_step, do_sample)
        )
    return views
