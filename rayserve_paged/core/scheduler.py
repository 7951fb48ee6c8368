"""Iteration-level scheduling with chunked prefill and all-or-nothing preemption of request
groups, by arrival (`fcfs`) or by (priority, arrival) (`priority`: lower is more urgent,
vLLM's --scheduling-policy).

Each step has one token budget (`max_num_batched_tokens`):
  1. decode   reserve one slot per running sequence, oldest group first; when blocks run
              out, preempt the most recently arrived running group (swap or recompute),
              repeating as needed. The oldest group never preempts itself: alone, it may
              use the whole pool, and when even that is too small its newest sequences end
              (finish_reason "length", stop_reason KV_CACHE_LIMIT) so the rest go on.
  2. prefill  running groups with prompt tokens left get the next chunk, FCFS.
  3. swap in  bring swapped groups back in FCFS order, unless this step preempted.
  4. admit    waiting groups in FCFS order (their first chunk) under the budgets and the
              watermark, unless anything is swapped or this step preempted; a group whose
              LoRA adapter can get no device slot waits, and the queue behind it
              (core/lora.py: pins, eviction, the slot deltas of the step message).

Queues are ordered by arrival: `running` oldest first (the tail is the next victim),
`swapped` and `waiting` oldest first (the head is the next to come back). Under `priority`
"oldest" reads "most urgent, then oldest" everywhere: every queue is ordered by the key
(priority, arrival), so the next victim is the least urgent, latest group and the next
admitted the most urgent, earliest. With every priority equal, the two policies make the
same steps token for token (`fcfs` is also the cheaper code: no keys are compared).

Liveness: while any request is unfinished, every step schedules at least one group (the
oldest running one, else the head of `swapped`, else the head of `waiting`, which then
runs alone and fits: start-up guarantees the pool holds one sequence of max_model_len).
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from dataclasses import dataclass, field

from rayserve_paged.core.block_manager import AllocStatus, BlockManager
from rayserve_paged.core.lora import LoRASlots
from rayserve_paged.core.outputs import NewRequest, ScheduledGroup, SchedulerOutput, StepMessage
from rayserve_paged.core.sequence import KV_CACHE_LIMIT, Sequence, SequenceGroup, SequenceStatus
from rayserve_paged.core.spec_decode import (
    DRAFT_MODEL,
    DRAFT_PLACEHOLDER,
    DraftRecord,
    SpeculativeConfig,
    count_positions,
    propose_ngram,
)


SCHEDULING_POLICIES = ("fcfs", "priority")


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"
    AUTO = "auto"  # recompute single-sequence groups, swap multi-sequence groups


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # "fcfs": queues by arrival; "priority": by (sampling_params.priority, arrival)
    policy: str = "fcfs"
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    enable_chunked_prefill: bool = True
    # A sequence whose prompt is shorter than this is recomputed from its start when it
    # reaches this length (Phi-3 LongRoPE: original_max_position_embeddings + 1, where
    # transformers' Phi-3 `generate` drops its cache and re-encodes the whole sequence
    # with the long factors); None: never.
    recompute_at_len: int | None = None
    # speculative decoding (core/spec_decode.py): n-gram drafts, or a draft model's; None: off
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self.preemption_mode = PreemptionMode(self.preemption_mode)
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)} (got {self.policy!r})")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) without chunked prefill: a prompt is prefilled in one step"
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
    spec_decode_num_draft_tokens: int = 0  # drafts scheduled for verification
    # [j]: rows that verified a draft at position j (0: the first draft)
    spec_decode_num_draft_tokens_per_position: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lora_slots: LoRASlots | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.lora_slots = lora_slots  # the workers' adapter slots (None: no LoRA)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.groups: dict[str, SequenceGroup] = {}  # every unfinished group, by request id
        self.counters = SchedulerCounters()
        if config.speculative is not None:  # every position reported from the start, 0 until drafted
            self.counters.spec_decode_num_draft_tokens_per_position = [0] * config.speculative.num_speculative_tokens
        self.by_priority = config.policy == "priority"
        # the decode fast path (below, in schedule); off, every group takes the general path,
        # with the same step as the result (a property test runs both)
        self.fast_decode = True
        self._has_finished_running = False
        # What the workers hold, and what changed since the last step (see StepMessage)
        self._params_sent: set[str] = set()  # requests whose state workers hold
        self._finished_ids: list[str] = []  # ... and that ended since the last step
        self._forks: list[tuple[int, int, int]] = []  # (parent, child, sample index)
        self._freed_seq_ids: list[int] = []  # sequences that ended while their request goes on

    # ------------------------------------------------------------------ requests

    def add_group(self, group: SequenceGroup) -> None:
        if group.request_id in self.groups:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        self.groups[group.request_id] = group
        if self.by_priority:
            _insert_by_key(self.waiting, group, _priority_key)
        else:
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
        self._unpin_lora(group)
        for seq in group.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.block_manager.free(seq)
        return group

    def fork_seq(self, group: SequenceGroup, parent: Sequence, child: Sequence) -> None:
        """The child joins the group and shares the parent's blocks; workers copy the
        parent's state to it (its place in the group seeds its sampling)."""
        self.block_manager.fork(parent, child)
        self._forks.append((parent.seq_id, child.seq_id, len(group.seqs)))
        child.is_on_workers = True
        group.seqs.append(child)

    def free_finished(self, group: SequenceGroup) -> None:
        """Release the blocks of the group's finished sequences (the engine has set their
        finished status); a group with none left unfinished leaves the scheduler."""
        bm = self.block_manager
        if not group.is_finished():
            for seq in group.seqs:
                if seq.status.is_finished:
                    self._release_seq(seq)
        for seq in group.seqs:
            if seq.status.is_finished:
                bm.free(seq)
        if group.is_finished():
            self.groups.pop(group.request_id, None)
            self._release_params(group.request_id)
            self._unpin_lora(group)
            self._has_finished_running = True

    def _pin_lora(self, group: SequenceGroup) -> None:
        if group.lora_request is not None and not group.has_lora_slot:
            self.lora_slots.acquire(group.lora_request)
            group.has_lora_slot = True

    def _unpin_lora(self, group: SequenceGroup) -> None:
        if group.has_lora_slot:
            self.lora_slots.release(group.lora_key)
            group.has_lora_slot = False

    def _release_seq(self, seq: Sequence) -> None:
        """The workers forget an ended sequence of a request that goes on, whether or not it
        holds blocks (it may end while its group waits to be recomputed)."""
        if seq.is_on_workers:
            seq.is_on_workers = False
            self._freed_seq_ids.append(seq.seq_id)

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
        bm = self.block_manager
        out = SchedulerOutput(block_tables=bm.gpu_tables)
        msg = out.message
        if self._finished_ids:
            msg.finished_request_ids, self._finished_ids = self._finished_ids, []
        if self._forks:
            msg.forks, self._forks = self._forks, []
        if self._freed_seq_ids:
            msg.freed_seq_ids, self._freed_seq_ids = self._freed_seq_ids, []
        if self._has_finished_running:
            self.running = [g for g in self.running if not g.is_finished()]
            self._has_finished_running = False
        budget = self.config.max_num_batched_tokens
        num_seqs = 0
        num_tokens = 0

        # -- decode: one slot per running sequence, oldest group first; preempt from the tail
        running = self.running
        prefilling: list[SequenceGroup] = []  # running groups with a prefill chunk to come
        # The fast path skips the per-group checks when no group can run short. It is safe
        # because (1) a decoding sequence needs at most one new block per step (a full last
        # block: one new block; a shared last block: one copy-on-write), prefill chunks need
        # none (admission and swap-in allocate the prompt's blocks), and (2) the running
        # groups' widths, each counted as max_num_running_seqs() (a fresh group at best_of,
        # before it forks), sum to at most max_num_seqs: admission and swap-in check it.
        # So max_num_seqs free blocks cover every sequence that can decode this step.
        # (Every sequence that can decode is in some running group's `seqs`: that many free
        # blocks is enough too.)
        num_free = bm.num_free_gpu_blocks()
        room = num_free >= self.config.max_num_seqs or num_free >= sum([len(g.seqs) for g in running])
        room = room and self.fast_decode
        # Drafts (speculative decoding) only while the batch is small, and never at the cost
        # of a block another sequence may need this step: each draft-free decode takes at
        # most one block, so that many stay free (with the watermark) after the drafts'.
        spec = self.config.speculative
        num_running_seqs = sum([len(g.seqs) for g in running]) if spec is not None else 0
        drafting = spec is not None and num_running_seqs < spec.disable_by_batch_size
        if drafting:
            spare_tokens = budget - num_running_seqs
            spare_blocks = num_free - num_running_seqs - bm.watermark_blocks
        # The common decode is inlined (one sequence, one new token): a row, and the block
        # manager only when the step needs a new block, a copy-on-write or a full block
        # registered for the prefix cache (1 step in 8 with 16-token blocks). Everything
        # else takes _schedule_decode.
        tables = bm.gpu_tables
        blocks = bm.gpu.blocks
        bs = bm.block_size
        seq_ids = msg.seq_ids
        add_seq_id = seq_ids.append
        add_start = msg.start_positions.append
        add_count = msg.num_query_tokens.append
        add_token = msg.token_ids.append
        add_scheduled = out.scheduled.append
        is_running = SequenceStatus.RUNNING
        recompute_at = self.config.recompute_at_len
        recomputed: list[SequenceGroup] = []
        inline_width = 1 if self.fast_decode else 0  # groups of this width take the inlined decode
        for group in running if room else self._groups_with_room(out):
            if group.is_prefilling:
                prefilling.append(group)
                num_seqs += group.max_num_running_seqs()  # its width once it forks
                continue
            if recompute_at is not None and _reaches(group, recompute_at):
                recomputed.append(group)
                continue
            seqs = group.seqs
            if drafting and len(seqs) == 1:
                drafts = self._drafts(group, spare_tokens, spare_blocks)
                if drafts:
                    spare_blocks -= self._schedule_drafts(group, drafts, out)
                    spare_tokens -= len(drafts)
                    num_tokens += 1 + len(drafts)
                    num_seqs += 1
                    continue
            if len(seqs) == inline_width:
                seq = seqs[0]
                token_ids = seq.token_ids
                end = len(token_ids)
                if seq.num_computed_tokens == end - 1 and seq.status is is_running:
                    table = tables[seq.seq_id]
                    num_blocks = len(table)
                    if (
                        end % bs == 0
                        or num_blocks * bs < end
                        or seq.num_blocks_sent != num_blocks
                        or blocks[table[-1]].ref_count > 1
                    ):
                        self._append_slots(seq, msg)
                    add_scheduled((group, len(seq_ids), 1, True, False))  # a ScheduledGroup
                    add_seq_id(seq.seq_id)
                    add_start(end - 1)
                    add_count(1)
                    add_token(token_ids[-1])
                    seq.num_computed_tokens = end
                    num_tokens += 1
                    num_seqs += 1
                    continue
            num_tokens += self._schedule_decode(group, out)
            num_seqs += group.max_num_running_seqs()
        for group in reversed(recomputed):  # oldest first at the head of the queue
            running.remove(group)
            self._recompute(group)
        preempted = bool(out.preempted)

        # -- prefill: the next chunk of each partly prefilled group, FCFS
        for group in prefilling:
            if num_tokens >= budget:
                break
            num_tokens += self._schedule_prefill(group, out, budget - num_tokens)

        # -- swap in: FCFS, unless this step preempted (its blocks are still leaving)
        while self.swapped and not preempted:
            group = self.swapped[0]
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            if recompute_at is not None and _reaches(group, recompute_at, SequenceStatus.SWAPPED):
                self.swapped.popleft()  # its CPU blocks go too: it is prefilled again
                self._recompute(group, SequenceStatus.SWAPPED)
                continue
            width = group.max_num_running_seqs()  # a group swapped while prefilling forks later
            if num_seqs + width > self.config.max_num_seqs:
                break
            if num_tokens + len(seqs) > budget:
                break
            alone = not running
            if not bm.can_swap_in(group, use_watermark=not alone):
                break
            self.swapped.popleft()
            msg.blocks_to_swap_in.extend(bm.swap_in(group))
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            if alone and not group.is_prefilling and not bm.can_append_slots(group):
                self._end_newest_seqs(group, out)
                if group.is_finished():
                    continue
            self._insert_running(group)
            num_seqs += group.max_num_running_seqs()
            if group.is_prefilling:
                num_tokens += self._schedule_prefill(group, out, budget - num_tokens)
            else:
                num_tokens += self._schedule_decode(group, out)

        # -- admit: FCFS, only while nothing is swapped out
        chunking = self.config.enable_chunked_prefill
        while self.waiting and not self.swapped and not preempted:
            group = self.waiting[0]
            seqs = group.get_seqs(SequenceStatus.WAITING)
            if max(len(s) for s in seqs) > self.config.max_model_len:
                self._end_group(self.waiting.popleft(), out)
                continue
            status = bm.can_allocate(group, use_watermark=bool(running))
            if status is AllocStatus.NEVER:
                if len(seqs) > 1:  # a recomputed group wider than the pool: it narrows
                    self._end_newest_seqs(group, out)
                    continue
                self._end_group(self.waiting.popleft(), out)
                continue
            if status is AllocStatus.LATER:
                break
            if num_seqs + group.max_num_running_seqs() > self.config.max_num_seqs:
                break
            # its adapter waits for a slot (FCFS: nothing behind it is admitted first)
            if group.lora_request is not None and not self.lora_slots.can_acquire(group.lora_key):
                break
            if chunking:
                if num_tokens >= budget:
                    break
            # Without chunking, budget by uncomputed tokens without prefix hits (an upper
            # bound); the first group of an empty batch always goes, so a recomputed wide
            # group cannot starve.
            elif out.scheduled and num_tokens + sum(len(s) for s in seqs) > budget:
                break
            self.waiting.popleft()
            bm.allocate(group)
            self._pin_lora(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self._insert_running(group)
            num_tokens += self._schedule_prefill(group, out, budget - num_tokens)
            num_seqs += group.max_num_running_seqs()
            out.num_prefill_groups += 1

        if self.lora_slots is not None:
            msg.lora_slot_updates = self.lora_slots.take_updates()
            msg.lora_forgets = self.lora_slots.take_forgets()
        if bm.kv_offload:  # tier 2: this step's offloads and restores ride the swap lists
            offloads, restores = bm.take_tier_copies()
            msg.blocks_to_swap_out.extend(offloads)
            msg.blocks_to_swap_in.extend(restores)
        out.num_batched_tokens = num_tokens
        return out

    def _groups_with_room(self, out: SchedulerOutput):
        """The running groups, oldest first, each once it can append its slots: newer
        groups are preempted (or the oldest, alone, narrows) until it can."""
        running = self.running
        i = 0
        while i < len(running):
            group = running[i]
            if not self.block_manager.can_append_slots(group) and not self._make_room(group, out):
                continue  # the group was preempted (it was the tail) or ended
            i += 1
            yield group

    def _schedule_decode(self, group: SequenceGroup, out: SchedulerOutput) -> int:
        """Emit the group's decode (one token per running sequence, each given a slot first);
        returns the number of tokens it computes. Runs for every running group every step:
        kept lean (no object per sequence; a block-table update only when the table grew
        or a copy-on-write replaced its last block)."""
        msg = out.message
        seq_ids = msg.seq_ids
        starts = msg.start_positions
        counts = msg.num_query_tokens
        tokens = msg.token_ids
        running = SequenceStatus.RUNNING
        first_row = len(seq_ids)
        num_tokens = 0
        for seq in group.seqs:
            if seq.status is not running:
                continue
            token_ids = seq.token_ids
            start = seq.num_computed_tokens
            end = len(token_ids)
            self._append_slots(seq, msg)
            seq_ids.append(seq.seq_id)
            starts.append(start)
            counts.append(end - start)
            if end - start == 1:
                tokens.append(token_ids[-1])
            else:
                tokens.extend(token_ids[start:])
            num_tokens += end - start
            seq.num_computed_tokens = end
        self._emit(group, first_row, out, True)
        return num_tokens

    # ------------------------------------------------------------------ speculative decoding

    def _drafts(self, group: SequenceGroup, spare_tokens: int, spare_blocks: int) -> list[int]:
        """The drafts of a decoding one-sequence group, within the step's spare tokens and
        blocks, max_tokens and max_model_len; [] where the request does not speculate (beam
        search, structured outputs, penalties, min_tokens still to reach). With a draft
        model: k placeholders, which the worker's draft model replaces."""
        seq = group.seqs[0]
        params = group.sampling_params
        end = len(seq.token_ids)
        if (
            seq.status is not SequenceStatus.RUNNING
            or seq.num_computed_tokens != end - 1
            or params.use_beam_search
            or params.structured_outputs is not None
            or params.needs_history
            or seq.num_output_tokens < params.min_tokens
        ):
            return []
        spec = self.config.speculative
        record = seq.draft_record
        if record is None:
            record = seq.draft_record = DraftRecord()
        if not record.drafts():  # paused: its recent drafts were mostly rejected
            return []
        k = min(spec.num_speculative_tokens, spare_tokens, self.config.max_model_len - end - 1)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - seq.num_output_tokens - 1)
        if k <= 0:
            return []
        bm = self.block_manager
        table = bm.gpu_tables[seq.seq_id]
        # blocks past those the plain decode takes (which the reserve already counts)
        extra = bm._num_blocks_for(end + k) - max(len(table), bm._num_blocks_for(end))
        if extra > spare_blocks:
            # as many as the blocks allow, never more than the caps above
            k = min(k, (max(len(table), bm._num_blocks_for(end)) + max(spare_blocks, 0)) * bm.block_size - end)
            if k <= 0:
                return []
        if spec.method == DRAFT_MODEL:
            return [DRAFT_PLACEHOLDER] * k
        return propose_ngram(seq.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _schedule_drafts(self, group: SequenceGroup, drafts: list[int], out: SchedulerOutput) -> int:
        """Emit the sequence's last token and its drafts as one row of 1 + k query tokens
        over its cached context; returns the blocks taken past the plain decode's. The
        engine then keeps what verification accepted (accept_drafts)."""
        msg = out.message
        seq = group.seqs[0]
        end = len(seq.token_ids)
        bm = self.block_manager
        table = bm.gpu_tables[seq.seq_id]
        plain = max(len(table), bm._num_blocks_for(end))
        self._append_slots(seq, msg, len(drafts))
        first_row = len(msg.seq_ids)
        msg.seq_ids.append(seq.seq_id)
        msg.start_positions.append(end - 1)
        msg.num_query_tokens.append(1 + len(drafts))
        msg.token_ids.append(seq.token_ids[-1])
        msg.token_ids.extend(drafts)
        msg.draft_seq_ids.append(seq.seq_id)
        msg.num_draft_tokens.append(len(drafts))
        seq.num_computed_tokens = end
        self.counters.spec_decode_num_draft_tokens += len(drafts)
        count_positions(self.counters.spec_decode_num_draft_tokens_per_position, len(drafts))
        self._emit(group, first_row, out, True)
        return len(table) - plain

    def accept_drafts(self, seq: Sequence) -> None:
        """After verification the sequence holds its accepted drafts and one more token:
        all but that last token are computed; the blocks of rejected drafts go back. The
        workers' longer table is cut with the sequence's next step: its last kept entry is
        sent again (an update from there replaces everything after it)."""
        accepted = len(seq.token_ids) - 1 - seq.num_computed_tokens
        seq.draft_record.verified(accepted, self.config.speculative.min_accepted_per_step)
        seq.num_computed_tokens = len(seq.token_ids) - 1
        table = self.block_manager.roll_back(seq, seq.num_computed_tokens)
        if len(table) < seq.num_blocks_sent:
            seq.num_blocks_sent = len(table) - 1

    def _append_slots(self, seq: Sequence, msg: StepMessage, num_lookahead: int = 0) -> None:
        """The block manager's slots for the sequence's new tokens (and `num_lookahead`
        draft tokens past them), and the workers' copy of its block table brought up to
        date: from the first entry they do not hold as is."""
        copies = msg.blocks_to_copy
        num_copies = len(copies)
        table = self.block_manager.append_slots(seq, copies, num_lookahead)
        sent = seq.num_blocks_sent
        if len(copies) != num_copies:  # copy-on-write replaced the last block (drafts' blocks may follow it)
            sent = min(sent, len(table) - 1 if not num_lookahead else table.index(copies[-1][1]))
        if sent != len(table):
            msg.block_table_updates.append((seq.seq_id, sent, table[sent:]))
            seq.num_blocks_sent = len(table)

    def _schedule_prefill(self, group: SequenceGroup, out: SchedulerOutput, budget: int) -> int:
        """Emit the group's next prefill chunk within `budget` tokens (everything left when it
        fits, or when chunking is off); returns the number of tokens it computes.

        A partial chunk leaves every sequence's last token for the step that samples, so the
        group samples all its sequences in one step. In a recomputed group the other
        sequences start past the prompt blocks they share with the first, so they wait until
        the first has computed those:

            first   [ shared prompt blocks ......... | own tokens ...... ]
            others                                   [ own tokens ........... ]
        """
        bm = self.block_manager
        msg = out.message
        seqs = [s for s in group.seqs if s.status is SequenceStatus.RUNNING]
        num_left = sum(len(s.token_ids) - s.num_computed_tokens for s in seqs)
        # Without chunked prefill a sequence is prefilled whole (it fits: max_model_len <=
        # the budget); only a recomputed group of several sequences, more than one step's
        # budget together, still goes in chunks: no step exceeds the budget.
        whole = num_left <= budget or (not self.config.enable_chunked_prefill and len(seqs) == 1)
        first = seqs[0]
        shared_end = first.num_prompt_tokens // bm.block_size * bm.block_size if len(seqs) > 1 else 0
        first_row = len(msg.seq_ids)
        num_tokens = 0
        for seq in seqs:
            start = seq.num_computed_tokens
            end = len(seq.token_ids)
            if not whole:
                if seq is not first and first.num_computed_tokens < shared_end:
                    break
                end = min(end - 1, start + budget - num_tokens)
                if end <= start:
                    continue
            table = bm.mark_computed(seq, end)
            sent = seq.num_blocks_sent
            if sent != len(table):
                msg.block_table_updates.append((seq.seq_id, sent, table[sent:]))
                seq.num_blocks_sent = len(table)
            msg.seq_ids.append(seq.seq_id)
            msg.start_positions.append(start)
            msg.num_query_tokens.append(end - start)
            msg.token_ids.extend(seq.token_ids[start:end])
            if not whole:
                msg.unsampled_seq_ids.append(seq.seq_id)
            num_tokens += end - start
            seq.num_computed_tokens = end
        group.is_prefilling = not whole
        if len(msg.seq_ids) > first_row:
            self._emit(group, first_row, out, whole)
        return num_tokens

    def _emit(self, group: SequenceGroup, first_row: int, out: SchedulerOutput, do_sample: bool) -> None:
        """Close the group's rows: its state for the workers on its first step, and the
        engine's record of them (a ScheduledGroup)."""
        msg = out.message
        first = group.seqs[0]
        request_id = group.request_id
        if request_id not in self._params_sent:
            self._params_sent.add(request_id)
            params = group.sampling_params
            needs_prompt = params.needs_history or params.prompt_logprobs is not None
            prompt = first.prompt_token_ids if needs_prompt else None
            msg.new_requests.append(
                NewRequest(request_id, first.seq_id, params, first.num_prompt_tokens, prompt, group.lora_key)
            )
            first.is_on_workers = True
        is_first_step = len(group.seqs) == 1 and len(first.token_ids) == first.num_prompt_tokens
        if is_first_step and do_sample:
            msg.first_step_seq_ids.append(first.seq_id)
        record: ScheduledGroup = (group, first_row, len(msg.seq_ids) - first_row, do_sample, is_first_step)
        out.scheduled.append(record)

    def _insert_running(self, group: SequenceGroup) -> None:
        if self.by_priority:
            _insert_by_key(self.running, group, _priority_key)
        else:
            _insert_by_arrival(self.running, group)

    # ------------------------------------------------------------------ preemption

    def _make_room(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """Free blocks until the running group can append its slots: preempt the newest
        running groups; the oldest group, left alone, narrows instead. Returns False when
        the group was preempted, or ended for want of even one sequence's blocks."""
        running = self.running
        while not self.block_manager.can_append_slots(group):
            if running[0] is group and len(running) == 1:
                self._end_newest_seqs(group, out)
                return not group.is_finished()
            victim = running.pop()
            self._preempt(victim, out)
            if victim is group:
                return False
        return True

    def _end_newest_seqs(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """The group alone cannot grow (or, recomputed, cannot fit) in the whole pool: end its
        newest unfinished sequences with finish_reason "length" (stop_reason KV_CACHE_LIMIT)
        until the rest fit. At least one sequence of max_model_len always fits a pool that
        start-up accepted; if even one does not, the group ends."""
        bm = self.block_manager
        for seq in reversed(group.seqs):
            status = seq.status
            if status.is_finished:
                continue
            if status is SequenceStatus.WAITING:
                fits = bm.can_allocate(group, use_watermark=False) is not AllocStatus.NEVER
            else:
                fits = bm.can_append_slots(group)
            if fits:
                return
            seq.status = SequenceStatus.FINISHED_LENGTH
            seq.stop_reason = KV_CACHE_LIMIT
            self._release_seq(seq)
            bm.free(seq)
        # nothing left that fits: the request ends here
        if group in self.running:
            self.running.remove(group)
        if self.waiting and self.waiting[0] is group:
            self.waiting.popleft()
        self._end_group(group, out)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        out.preempted.append(group.request_id)
        mode = self.config.preemption_mode
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        wants_swap = mode is PreemptionMode.SWAP or (mode is PreemptionMode.AUTO and len(seqs) > 1)
        if wants_swap and self.block_manager.can_swap_out(group):
            out.message.blocks_to_swap_out.extend(self.block_manager.swap_out(group))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
                seq.num_blocks_sent = 0  # swap-in hands out new block ids
            if self.by_priority:
                _insert_by_key(self.swapped, group, _priority_key)
            else:
                self.swapped.appendleft(group)
            self.counters.preemptions_swap += 1
            return
        # Recompute (also the fallback when the CPU pool is full: never abort for lack of it).
        self._recompute(group)
        self.counters.preemptions_recompute += 1

    def _recompute(self, group: SequenceGroup, status: SequenceStatus = SequenceStatus.RUNNING) -> None:
        """Free the group's blocks (its `status` sequences'); it waits at the head of the
        queue to prefill every token (prompt and output) again."""
        for seq in group.get_seqs(status):
            self.block_manager.free(seq)
            seq.reset_for_recompute()
        group.is_prefilling = False
        self._unpin_lora(group)  # its adapter's slot is taken again on re-admission
        if self.by_priority:
            _insert_by_key(self.waiting, group, _priority_key)
        else:
            self.waiting.appendleft(group)

    def _end_group(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """The request can never run (longer than max_model_len, or more than the whole
        pool): it ends and is reported in `out.ignored`."""
        for seq in group.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_IGNORED
            self.block_manager.free(seq)
        self.groups.pop(group.request_id, None)
        self._release_params(group.request_id)
        self._unpin_lora(group)
        out.ignored.append(group.request_id)


def _reaches(group: SequenceGroup, length: int, status: SequenceStatus = SequenceStatus.RUNNING) -> bool:
    """A sequence of the group (of `status`) is `length` tokens long, all computed below it
    (its prompt was shorter): its next decode would be the recompute_at_len one."""
    return any(len(seq.token_ids) == length and seq.num_prompt_tokens < length for seq in group.get_seqs(status))


def _priority_key(group: SequenceGroup) -> tuple[int, int]:
    return group.sampling_params.priority, group.arrival_index


def _insert_by_key(queue: list[SequenceGroup] | deque[SequenceGroup], group: SequenceGroup, key) -> None:
    """Keep `queue` ordered by `key` (ties cannot happen: arrival indices are unique).
    Nearly always an append at one end; otherwise a binary search (a deque is indexed in
    O(n) toward its middle: this runs only under the priority policy)."""
    k = key(group)
    if not queue or key(queue[-1]) < k:
        queue.append(group)
    elif key(queue[0]) > k:
        queue.insert(0, group)
    else:
        queue.insert(bisect.bisect(queue, k, key=key), group)


def _insert_by_arrival(running: list[SequenceGroup], group: SequenceGroup) -> None:
    """Keep `running` oldest first. Nearly always an append; a group recomputed while a
    later one was swapped out can come back after it, and then goes in its place."""
    if not running or running[-1].arrival_index < group.arrival_index:
        running.append(group)
    else:
        bisect.insort(running, group, key=lambda g: g.arrival_index)
