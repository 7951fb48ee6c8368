"""What the scheduler hands to the workers each step: plain, picklable data.

Only ids, token ids, positions, block tables and (src, dst) block lists cross the process
boundary; never sequences, tensors or policy objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayserve_paged.core.sequence import SamplingParams

BlockMapping = list[tuple[int, int]]


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


@dataclass(slots=True)
class ScheduledGroup:
    request_id: str
    seqs: list[ScheduledSeq]
    sampling_params: SamplingParams
    num_prompt_tokens: int
    is_first_step: bool  # no token sampled yet: the sampler draws best_of samples


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

    @property
    def is_empty(self) -> bool:
        return not (self.groups or self.blocks_to_swap_out)

    @property
    def num_seqs(self) -> int:
        return sum(len(g.seqs) for g in self.groups)
