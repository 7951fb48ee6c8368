"""What one scheduler step produces.

Two objects, for two readers:

  StepMessage      what crosses the process boundary to every worker rank: plain, columnar
                   and a delta. Workers keep each request's state (parameters, block tables,
                   token history where penalties need it) across steps, so a step carries
                   only what changed: new requests, forks, freed sequences, block-table
                   updates, this step's rows and the swap/copy lists. A decode of 256
                   sequences with no block boundary crossed is three lists of 256 ints.
  SchedulerOutput  the step as the engine sees it: the message plus, per scheduled group,
                   the group itself (never pickled).

    rows        seq_ids[i], start_positions[i], num_query_tokens[i]; the rows' new tokens
                concatenated in `token_ids`. A group's rows are contiguous.
    positions   0 .......... start-1 | start ........ start+num_query_tokens-1
                K/V already cached   | computed this step (written, then attended)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.pickling import compact_pickle

if TYPE_CHECKING:
    from rayserve_paged.core.sequence import SequenceGroup

BlockMapping = list[tuple[int, int]]


@compact_pickle
@dataclass(slots=True)
class NewRequest:
    """Sent once, with the request's first scheduled step; workers keep it until the id
    appears in `StepMessage.finished_request_ids`."""

    request_id: str
    seq_id: int  # its first sequence (the others arrive as forks)
    sampling_params: SamplingParams
    num_prompt_tokens: int
    # the whole prompt, only when sampling needs the token history (penalties) and the
    # first chunk may not carry all of it (a prefix-cache hit); else None
    prompt_token_ids: list[int] | None = None
    # its LoRA adapter's identity (core/lora.LoRAKey; None: the base model); its slot is in
    # lora_slot_updates
    lora_key: tuple[int, str, str] | None = None

    @property
    def lora_id(self) -> int:
        return 0 if self.lora_key is None else self.lora_key[0]


@compact_pickle
@dataclass(slots=True)
class StepMessage:
    """One step for the workers. They apply it in this order (InputBatch.apply, then the
    worker): fork (the parents exist before anything ends), free ended sequences, forget
    finished requests (with their sequences), add new requests (an id that ended may come
    back as a new request in the same step: forgotten first), update block tables; then
    swap out, swap in, copy; load the changed LoRA slots; then run the rows."""

    finished_request_ids: list[str] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    forks: list[tuple[int, int, int]] = field(default_factory=list)  # (parent, child, sample index)
    freed_seq_ids: list[int] = field(default_factory=list)  # ended while their request goes on
    # (seq_id, start, block ids): the worker's table becomes table[:start] + block ids
    block_table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)
    blocks_to_swap_out: BlockMapping = field(default_factory=list)  # (gpu id, cpu id)
    blocks_to_swap_in: BlockMapping = field(default_factory=list)  # (cpu id, gpu id)
    blocks_to_copy: BlockMapping = field(default_factory=list)  # (src gpu id, dst gpu id)
    # the rows: one per scheduled sequence
    seq_ids: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    num_query_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # every row's new tokens, concatenated
    # rows that sample nothing (a prefill chunk ending before the prompt does)
    unsampled_seq_ids: list[int] = field(default_factory=list)
    # rows whose group samples for the first time: best_of draws (n > 1 forks from them)
    first_step_seq_ids: list[int] = field(default_factory=list)
    # rows that verify drafts (speculative decoding): the last num_draft_tokens[i] query
    # tokens of seq draft_seq_ids[i]'s row are drafts; the row samples at every one of its
    # 1 + k positions and returns the accepted drafts and one more token
    draft_seq_ids: list[int] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)
    # constrained rows (structured outputs): the engine's grammar matchers allow only some
    # tokens next. token_bitmasks packs one bitmask per seq id in bitmask_seq_ids, in order:
    # little-endian int32 words, bit j of word w set = token 32 * w + j allowed
    bitmask_seq_ids: list[int] = field(default_factory=list)
    token_bitmasks: bytes = b""
    # LoRA adapters retired (core/lora.py): the workers drop their tensors, first; then the
    # slots that changed: (slot, adapter key), filled from the tensors the workers were given
    # at registration (never read from disk here), applied before the rows; a row's slot is
    # its request's adapter's
    lora_forgets: list[tuple[int, str, str]] = field(default_factory=list)
    lora_slot_updates: list[tuple[int, tuple[int, str, str]]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do (not even to forget something)."""
        return not (
            self.seq_ids
            or self.start_positions
            or self.num_query_tokens
            or self.token_ids
            or self.finished_request_ids
            or self.new_requests
            or self.forks
            or self.freed_seq_ids
            or self.block_table_updates
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
            or self.blocks_to_copy
            or self.unsampled_seq_ids
            or self.first_step_seq_ids
            or self.draft_seq_ids
            or self.num_draft_tokens
            or self.bitmask_seq_ids
            or self.token_bitmasks
            or self.lora_slot_updates
            or self.lora_forgets
        )

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)


# One scheduled group's rows in the step (never pickled), read by unpacking in this order:
#
#     group, first_row, num_rows, do_sample, is_first_step = record
#
# rows [first_row, first_row + num_rows) of the message; do_sample False: a prefill chunk
# that ends before the group's last token; is_first_step: no token sampled yet (the sampler
# draws best_of samples). A plain tuple on purpose: one is built for every scheduled group
# every step, and a NamedTuple costs 0.1 us more to build, a fifth of a 256-sequence decode
# step (benchmarks/scheduler_step.py).
ScheduledGroup = tuple["SequenceGroup", int, int, bool, bool]


@dataclass(slots=True)
class SchedulerOutput:
    message: StepMessage = field(default_factory=StepMessage)
    scheduled: list[ScheduledGroup] = field(default_factory=list)  # per scheduled group, in row order
    num_batched_tokens: int = 0
    num_prefill_groups: int = 0
    preempted: list[str] = field(default_factory=list)  # request ids preempted this step
    ignored: list[str] = field(default_factory=list)  # request ids that can never run
    block_tables: dict[int, list[int]] | None = None  # the block manager's live tables (for views of the step)

    @property
    def is_empty(self) -> bool:
        return self.message.is_empty
