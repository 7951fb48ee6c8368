"""The worker's persistent batch: what each rank keeps about its requests across steps.

The scheduler sends each request's parameters once, each block-table change once and each
step's new tokens once (core/outputs.py StepMessage); the worker keeps the rest:

    requests   request id -> parameters, prompt length, its live sequences
    seqs       seq id     -> its request, block table, place in the group, and its token
                             history when sampling needs it (penalties)

Forks copy the parent's state on the worker (n > 1, beam search); nothing of a sequence's
history travels again. A request's state leaves with `finished_request_ids`, a sequence's
with `freed_seq_ids`; `num_requests` / `num_seqs` are zero once every request has ended.
Each step's sampler batch is built here too (`sampling_batch`), from the rows' state.
"""

from __future__ import annotations

from collections.abc import Sequence

from rayserve_paged.core.outputs import StepMessage
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.models.sampler import SamplingBatch
from rayserve_paged.worker.sampling_inputs import RowTemplate, row_template, sampling_batch, unpack_step_bitmasks


class RequestState:
    __slots__ = ("request_id", "params", "template", "num_prompt_tokens", "seq_ids", "lora_key", "prompt_token_ids",
                 "pooled")  # fmt: skip

    def __init__(
        self, request_id: str, params: SamplingParams, template: RowTemplate, num_prompt_tokens: int, lora_key=None
    ) -> None:
        self.request_id = request_id
        self.lora_key = lora_key  # its LoRA adapter (core/lora.LoRAKey; None: the base model)
        self.params = params
        self.template = template  # its rows' sampler columns, derived once
        self.num_prompt_tokens = num_prompt_tokens
        self.seq_ids: set[int] = set()
        self.prompt_token_ids: list[int] | None = None  # kept only for prompt logprobs
        self.pooled = None  # a pooling request's running sum (mean) or first hidden state (cls)


class SeqState:
    __slots__ = ("seq_id", "request", "block_table", "sample_index", "history", "num_computed_max")

    def __init__(
        self, seq_id: int, request: RequestState, block_table: list[int], sample_index: int, history: list[int] | None,
        num_computed_max: int = 0,
    ) -> None:
        self.seq_id = seq_id
        self.request = request
        self.block_table = block_table  # GPU block ids, as the scheduler's table
        self.sample_index = sample_index  # its place in the group (seeded sampling)
        self.history = history  # every token id known so far, when penalties need them
        # one past the furthest position computed (kept only for Phi-3 LongRoPE; a recompute
        # does not lower it)
        self.num_computed_max = num_computed_max


class StepStateError(RuntimeError):
    """The step message refers to state this worker does not hold (a scheduler bug)."""


class InputBatch:
    def __init__(self, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.eos_token_ids = eos_token_ids  # masked before a request's min_tokens
        self.requests: dict[str, RequestState] = {}
        self.seqs: dict[int, SeqState] = {}
        # requests whose steps read every new token's hidden state (prompt logprobs,
        # pooling): while none is held, a step does not look for them
        self.num_full_prefill = 0

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def apply(self, msg: StepMessage) -> None:
        """Bring the state up to this step (everything but the rows' tokens)."""
        seqs = self.seqs
        for parent_id, child_id, sample_index in msg.forks:
            parent = self._seq(parent_id)
            history = None if parent.history is None else list(parent.history)
            seqs[child_id] = SeqState(
                child_id, parent.request, list(parent.block_table), sample_index, history, parent.num_computed_max
            )
            parent.request.seq_ids.add(child_id)
        for seq_id in msg.freed_seq_ids:
            seq = seqs.pop(seq_id, None)
            if seq is not None:
                seq.request.seq_ids.discard(seq_id)
        for request_id in msg.finished_request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self.num_full_prefill -= request.params.is_full_prefill
                for seq_id in request.seq_ids:
                    seqs.pop(seq_id, None)
        for new in msg.new_requests:
            template = row_template(new.sampling_params, self.eos_token_ids)
            request = RequestState(new.request_id, new.sampling_params, template, new.num_prompt_tokens, new.lora_key)
            self.requests[new.request_id] = request
            self.num_full_prefill += new.sampling_params.is_full_prefill
            if new.sampling_params.prompt_logprobs is not None:
                request.prompt_token_ids = new.prompt_token_ids
            history = None
            if new.sampling_params.needs_history:
                history = list(new.prompt_token_ids or ())
            seqs[new.seq_id] = SeqState(new.seq_id, request, [], 0, history)
            request.seq_ids.add(new.seq_id)
        for seq_id, start, blocks in msg.block_table_updates:
            table = self._seq(seq_id).block_table
            del table[start:]
            table.extend(blocks)

    def _seq(self, seq_id: int) -> SeqState:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise StepStateError(f"the step refers to sequence {seq_id}, which this worker does not hold")
        return seq

    def rows(self, msg: StepMessage) -> list[SeqState]:
        """The state of each row, in row order."""
        seqs = self.seqs
        try:
            return [seqs[seq_id] for seq_id in msg.seq_ids]
        except KeyError as e:
            return [self._seq(e.args[0])]  # raises StepStateError, naming the sequence

    def sampling_batch(self, msg: StepMessage, rows: Sequence[SeqState], skip=()) -> SamplingBatch:
        """The batch for a step's sampled rows, in row order, from this state (`rows[i]` is
        the state of the message's row i, as `rows(msg)` gives); rows of `skip` (seq ids:
        the drafting rows, see draft_sampling_batch) left out."""
        unsampled = set(msg.unsampled_seq_ids) | set(skip)
        first_step = set(msg.first_step_seq_ids)
        starts = msg.start_positions
        counts = msg.num_query_tokens
        batch_rows = []
        append = batch_rows.append
        for i, seq in enumerate(rows):
            seq_id = seq.seq_id
            if unsampled and seq_id in unsampled:
                continue
            request = seq.request
            t = request.template
            num_prompt = request.num_prompt_tokens
            if first_step and seq_id in first_step:
                append((t, seq_id, 0, starts[i] + counts[i] - num_prompt, t.num_first_draws, seq.history, num_prompt))
            else:
                append((t, seq_id, seq.sample_index, starts[i] + counts[i] - num_prompt, 1, seq.history, num_prompt))
        if not msg.bitmask_seq_ids:
            return sampling_batch(batch_rows)
        row_of = {row[1]: i for i, row in enumerate(batch_rows)}
        bitmask_rows = [row_of[seq_id] for seq_id in msg.bitmask_seq_ids]
        return sampling_batch(batch_rows, bitmask_rows, unpack_step_bitmasks(msg))

    def draft_sampling_batch(
        self, msg: StepMessage, rows: Sequence[SeqState], drafts: dict[int, int], position: int | None = None
    ) -> SamplingBatch:
        """The batch of the drafting rows (seq id -> k drafts), in row order: 1 + k entries
        each, one per verified position, the j-th at output index + j (its seed's draw).
        `position` j: only the j-th entry of each row with more than j drafts (what a
        draft model draws its draft j + 1 with). Drafting requests have no penalties,
        bitmasks or min_tokens left (core/scheduler.py)."""
        batch_rows = []
        for i, seq in enumerate(rows):
            k = drafts.get(seq.seq_id)
            if k is None:
                continue
            request = seq.request
            num_prompt = request.num_prompt_tokens
            first = msg.start_positions[i] + 1 - num_prompt  # the output index of the row's first sample
            positions = range(k + 1) if position is None else range(position, position + 1 if position < k else 0)
            batch_rows += [(request.template, seq.seq_id, seq.sample_index, first + j, 1, None, num_prompt)
                           for j in positions]  # fmt: skip
        return sampling_batch(batch_rows)
