"""What the scheduler hands to the workers each step: plain, picklable data.

Only ids, token ids, positions, block tables and (src, dst) block lists cross the process
boundary; never sequences, tensors or policy objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.pickling import compact_pickle

BlockMapping = list[tuple[int, int]]


@compact_pickle
@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in a step.

        positions   0 ........ start_pos-1 | start_pos ........ start_pos+len(token_ids)-1
                    K/V already in cache   | computed this step (written, then attended)
    """

    seq_id: int
    token_ids: list[int]  # tokens computed this step (one for a decode)
    start_pos: int  # tokens of this sequence already in the cache before the step
    block_table: list[int]  # GPU block ids covering positions [0, start_pos + len(token_ids))
    num_output_tokens: int  # output tokens so far (seeded sampling draws by this index)
    sample_index: int  # the sequence's place in its group (seeded sampling draws by it too)
    history: list[int] | None = None  # every token id, only when penalties need them


@compact_pickle
@dataclass(slots=True)
class ScheduledGroup:
    request_id: str
    seqs: list[ScheduledSeq]
    # Sent with a request's first scheduled step only; None afterwards: workers keep it
    # until the request id appears in SchedulerOutput.finished_request_ids.
    sampling_params: SamplingParams | None
    num_prompt_tokens: int
    is_first_step: bool  # no token sampled yet: the sampler draws best_of samples
    # False for a chunk of a prefill that ends before the group's last token: computed,
    # nothing sampled (the group samples in the step that computes its last chunk).
    do_sample: bool = True


@compact_pickle
@dataclass(slots=True)
class SchedulerOutput:
    groups: list[ScheduledGroup] = field(default_factory=list)
    # Workers apply these in this order, before the model runs: swap out, swap in, copy.
    blocks_to_swap_out: BlockMapping = field(default_factory=list)  # (gpu id, cpu id)
    blocks_to_swap_in: BlockMapping = field(default_factory=list)  # (cpu id, gpu id)
    blocks_to_copy: BlockMapping = field(default_factory=list)  # (src gpu id, dst gpu id)
    num_batched_tokens: int = 0
    num_prefill_groups: int = 0
    preempted: list[str] = field(default_factory=list)  # request ids preempted this step
    ignored: list[str] = field(default_factory=list)  # request ids that can never run
    finished_request_ids: list[str] = field(default_factory=list)  # workers forget these

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do (not even to forget finished requests)."""
        return not (self.groups or self.blocks_to_swap_out or self.finished_request_ids)

    @property
    def num_seqs(self) -> int:
        return sum(len(g.seqs) for g in self.groups)
