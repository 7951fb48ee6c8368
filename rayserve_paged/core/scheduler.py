"""FCFS, iteration-level scheduling with all-or-nothing preemption of request groups.

Each step:
  1. decode   reserve one slot per running sequence, oldest group first; when blocks run
              out, preempt the most recently arrived running group (swap or recompute),
              repeating as needed — possibly the group itself.
  2. swap in  bring swapped groups back in FCFS order, unless this step preempted.
  3. admit    waiting groups in FCFS order under the budgets and the watermark, unless
              anything is swapped or this step preempted.

Queues are ordered by arrival: `running` oldest first (the tail is the next victim),
`swapped` and `waiting` oldest first (the head is the next to come back).
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from dataclasses import dataclass

from rayserve_paged.core.block_manager import AllocStatus, BlockManager
from rayserve_paged.core.outputs import ScheduledGroup, ScheduledSeq, SchedulerOutput
from rayserve_paged.core.sequence import Sequence, SequenceGroup, SequenceStatus


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"
    AUTO = "auto"  # recompute single-sequence groups, swap multi-sequence groups


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = PreemptionMode.AUTO

    def __post_init__(self) -> None:
        self.preemption_mode = PreemptionMode(self.preemption_mode)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}): a prompt is prefilled in one step"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence decodes one token per step"
            )


@dataclass(slots=True)
class SchedulerCounters:
    preemptions_recompute: int = 0
    preemptions_swap: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.groups: dict[str, SequenceGroup] = {}  # every unfinished group, by request id
        self.counters = SchedulerCounters()
        self._has_finished_running = False
        self._params_sent: set[str] = set()  # requests whose sampling params workers hold
        self._finished_ids: list[str] = []  # ... and that ended since the last step

    # ------------------------------------------------------------------ requests

    def add_group(self, group: SequenceGroup) -> None:
        if group.request_id in self.groups:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        self.groups[group.request_id] = group
        self.waiting.append(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Finish the request wherever it is and free everything it holds."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self._release_params(request_id)
        for queue in (self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        if group in self.running:
            self.running.remove(group)
        for seq in group.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.block_manager.free(seq)
        return group

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent, child)

    def free_finished(self, group: SequenceGroup) -> None:
        """Release the blocks of the group's finished sequences (the engine has set their
        finished status); a group with none left unfinished leaves the scheduler."""
        for seq in group.seqs:
            if seq.status.is_finished:
                self.block_manager.free(seq)
        if group.is_finished():
            self.groups.pop(group.request_id, None)
            self._release_params(group.request_id)
            self._has_finished_running = True

    def _release_params(self, request_id: str) -> None:
        if request_id in self._params_sent:
            self._params_sent.discard(request_id)
            self._finished_ids.append(request_id)

    @property
    def num_unfinished_groups(self) -> int:
        return len(self.groups)

    def has_unfinished_groups(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self._finished_ids:
            out.finished_request_ids, self._finished_ids = self._finished_ids, []
        if self._has_finished_running:
            self.running = [g for g in self.running if not g.is_finished()]
            self._has_finished_running = False
        num_seqs = 0
        num_tokens = 0

        # -- decode: one slot per running sequence, oldest group first; preempt from the tail
        running = self.running
        # Each sequence needs at most one new block per step: with that many free, no
        # group can run short and the per-group checks are skipped.
        room = self.block_manager.num_free_gpu_blocks() >= sum(len(g.seqs) for g in running)
        i = 0
        while i < len(running):
            group = running[i]
            while not room and not self.block_manager.can_append_slots(group):
                victim = running.pop()
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                num_tokens += self._schedule_group(group, out, reserve=True)
                num_seqs += len(out.groups[-1].seqs)
                i += 1
        preempted = bool(out.preempted)

        # -- swap in: FCFS, unless this step preempted (its blocks are still leaving)
        while self.swapped and not preempted:
            group = self.swapped[0]
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            if num_seqs + len(seqs) > self.config.max_num_seqs:
                break
            if num_tokens + len(seqs) > self.config.max_num_batched_tokens:
                break
            if not self.block_manager.can_swap_in(group):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(group))
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            num_tokens += self._schedule_group(group, out, reserve=True)
            num_seqs += len(seqs)
            _insert_by_arrival(running, group)

        # -- admit: FCFS, only while nothing is swapped out
        while self.waiting and not self.swapped and not preempted:
            group = self.waiting[0]
            seqs = group.get_seqs(SequenceStatus.WAITING)
            if max(len(s) for s in seqs) > self.config.max_model_len:
                self._ignore(self.waiting.popleft(), out)
                continue
            status = self.block_manager.can_allocate(group)
            if status is AllocStatus.NEVER:
                self._ignore(self.waiting.popleft(), out)
                continue
            if status is AllocStatus.LATER:
                break
            if num_seqs + group.max_num_running_seqs() > self.config.max_num_seqs:
                break
            # Budget by uncomputed tokens without prefix hits (an upper bound); the first
            # group of an empty batch always goes, so a recomputed wide group cannot starve.
            new_tokens = sum(len(s) for s in seqs)
            if out.groups and num_tokens + new_tokens > self.config.max_num_batched_tokens:
                break
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            num_tokens += self._schedule_group(group, out, reserve=False)
            num_seqs += group.max_num_running_seqs()
            out.num_prefill_groups += 1
            _insert_by_arrival(running, group)

        out.num_batched_tokens = num_tokens
        return out

    def _schedule_group(self, group: SequenceGroup, out: SchedulerOutput, reserve: bool) -> int:
        """Emit the group's work for this step; returns the number of tokens it computes.
        `reserve`: first give each sequence slots for its uncomputed tokens (admission has
        already allocated them). Runs for every running group every step: kept lean."""
        bm = self.block_manager
        copies = out.blocks_to_copy
        needs_history = group.sampling_params.needs_history
        running = SequenceStatus.RUNNING
        scheduled = []
        num_tokens = 0
        for index, seq in enumerate(group.seqs):
            if seq.status is not running:
                continue
            token_ids = seq.token_ids
            start = seq.num_computed_tokens
            end = len(token_ids)
            table = bm.append_slots(seq, copies) if reserve else bm.gpu_tables[seq.seq_id]
            scheduled.append(
                ScheduledSeq(
                    seq.seq_id,
                    token_ids[start:],
                    start,
                    table.copy(),
                    end - seq.num_prompt_tokens,
                    index,
                    token_ids.copy() if needs_history else None,
                )
            )
            num_tokens += end - start
            seq.num_computed_tokens = end
        first = group.seqs[0]
        params = None
        if group.request_id not in self._params_sent:
            self._params_sent.add(group.request_id)
            params = group.sampling_params
        out.groups.append(
            ScheduledGroup(
                group.request_id,
                scheduled,
                params,
                first.num_prompt_tokens,
                len(group.seqs) == 1 and len(first.token_ids) == first.num_prompt_tokens,
            )
        )
        return num_tokens

    # ------------------------------------------------------------------ preemption

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        out.preempted.append(group.request_id)
        mode = self.config.preemption_mode
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        wants_swap = mode is PreemptionMode.SWAP or (mode is PreemptionMode.AUTO and len(seqs) > 1)
        if wants_swap and self.block_manager.can_swap_out(group):
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(group))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(group)
            self.counters.preemptions_swap += 1
            return
        # Recompute (also the fallback when the CPU pool is full: never abort for lack of it).
        for seq in seqs:
            self.block_manager.free(seq)
            seq.reset_for_recompute()
        self.waiting.appendleft(group)
        self.counters.preemptions_recompute += 1

    def _ignore(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        for seq in group.seqs:
            seq.status = SequenceStatus.FINISHED_IGNORED
        self.groups.pop(group.request_id, None)
        out.ignored.append(group.request_id)


def _insert_by_arrival(running: list[SequenceGroup], group: SequenceGroup) -> None:
    """Keep `running` oldest first. Nearly always an append; a group recomputed while a
    later one was swapped out can come back after it, and then goes in its place."""
    if not running or running[-1].arrival_index < group.arrival_index:
        running.append(group)
    else:
        bisect.insort(running, group, key=lambda g: g.arrival_index)
