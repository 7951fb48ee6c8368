"""StepMessage -> model inputs -> logits -> samples, for one tensor-parallel rank.

The rank's persistent batch (worker/input_batch.py) holds each request's state; a step
brings only its changes and this step's tokens. The step's tokens are packed
prefill-first (see ops/attention.py); `logits_indices` picks each sampled row's last new
token, in row order, for the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayserve_paged.core.outputs import StepMessage
from rayserve_paged.models.layers import ROPE_LEN_PER_SEQUENCE
from rayserve_paged.models.lora import LoRAPool
from rayserve_paged.models.sampler import Sampler, SamplerOutput, prompt_logprobs
from rayserve_paged.ops.attention import AttentionMetadata
from rayserve_paged.ops.cache_ops import slot_of
from rayserve_paged.worker.input_batch import InputBatch, SeqState
from rayserve_paged.worker.static_decode import StaticDecode, decode_rows, rope_lens_of


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64: last new token of each sampled row
    lora_token_slots: list[int] | None = None  # per token, its row's adapter slot (-1: base)


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, block_size: int, device: torch.device, sampler: Sampler | None, attn_backend=None,
        static_decode: StaticDecode | None = None,
    ):
        self.model = model
        self.attn_backend = attn_backend  # begin_step(metadata) once per step, before the layers
        self.block_size = block_size
        self.device = device
        self.sampler = sampler  # only the rank that returns samples has one
        self.batch = InputBatch(sampler.eos_token_ids if sampler is not None else ())
        self.static_decode = static_decode  # decode-only steps within its buckets: padded, CUDA graphs
        self.rope_len_rule: str | None = getattr(model, "rope_len_rule", None)  # dynamic NTK / LongRoPE
        self.last_path = ""  # the last step's: "eager", "static-graph" or "static-eager" (padded, no graph)
        self.lora: LoRAPool | None = None  # the adapter slots, when the engine serves LoRA
        self.staging = StepStaging(device)  # an eager step's inputs: one buffer, one copy
        # the draft model (worker/draft_model.py), when speculative decoding has one: it runs
        # over every step's tokens and proposes the drafting rows' drafts before the target runs
        self.drafter = None

    def prepare(self, msg: StepMessage, rows: list[SeqState]) -> StepInputs:
        bs = self.block_size
        counts = msg.num_query_tokens
        starts = msg.start_positions
        tokens = msg.token_ids
        offsets = [0] * (len(counts) + 1)  # row i's tokens: tokens[offsets[i]:offsets[i + 1]]
        for i, n in enumerate(counts):
            offsets[i + 1] = offsets[i] + n
        prefills = [i for i, n in enumerate(counts) if n > 1]
        decodes = [i for i, n in enumerate(counts) if n == 1] if prefills else range(len(counts))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_index = [0] * len(counts)  # row -> its last token's place in the packed step
        for i in prefills:
            table = rows[i].block_table
            start = starts[i]
            end = start + counts[i]
            slots.extend(slot_of(table, pos, bs) for pos in range(start, end))
            positions.extend(range(start, end))
            input_ids.extend(tokens[offsets[i] : offsets[i + 1]])
            last_index[i] = len(input_ids) - 1
        num_prefill_tokens = len(input_ids)
        for j, i in enumerate(decodes):
            pos = starts[i]
            slots.append(slot_of(rows[i].block_table, pos, bs))
            last_index[i] = num_prefill_tokens + j
        if prefills:
            input_ids.extend(tokens[offsets[i]] for i in decodes)
            positions.extend(starts[i] for i in decodes)
        else:  # decodes only: the message's columns are the inputs
            input_ids = tokens
            positions = starts
        query_lens = [counts[i] for i in prefills]
        prefill_seq_lens = [starts[i] + counts[i] for i in prefills]
        decode_seq_lens = [starts[i] + 1 for i in decodes]
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        unsampled = set(msg.unsampled_seq_ids)
        rope_lens = None
        if self.rope_len_rule is not None:  # in packing order: prefill rows' tokens, then the decodes
            rule = self.rope_len_rule
            rope_lens = [n for i in [*prefills, *decodes] for n in rope_lens_of(rows[i], starts[i], counts[i], rule)]
        sampled = last_index if not unsampled else [last_index[i] for i, s in enumerate(msg.seq_ids) if s not in unsampled]
        if msg.draft_seq_ids:  # a row verifying k drafts samples at its last 1 + k tokens
            drafts = dict(zip(msg.draft_seq_ids, msg.num_draft_tokens))
            sampled = [
                j for i, s in enumerate(msg.seq_ids) if s not in unsampled
                for j in range(last_index[i] - drafts.get(s, 0), last_index[i] + 1)
            ]  # fmt: skip
        prefill_tables, prefill_width = _padded([rows[i].block_table for i in prefills])
        decode_tables, decode_width = _padded([rows[i].block_table for i in decodes])
        longs, ints = self.staging.stage(
            [input_ids, positions, slots, sampled, rope_lens or []],
            [query_start, [starts[i] for i in prefills], prefill_seq_lens, decode_seq_lens, prefill_tables,
             decode_tables],
        )  # fmt: skip
        ids_t, positions_t, slots_t, sampled_t, rope_t = longs
        start_t, context_t, prefill_lens_t, decode_lens_t, prefill_tables_t, decode_tables_t = ints
        metadata = AttentionMetadata(
            slot_mapping=slots_t,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=len(decodes),
            block_size=bs,
            prefill_query_start_loc=start_t,
            prefill_context_lens=context_t,
            prefill_seq_lens=prefill_lens_t,
            prefill_block_tables=prefill_tables_t.view(len(prefills), prefill_width),  # [n, max_blocks]
            max_prefill_query_len=max(query_lens, default=0),
            max_prefill_seq_len=max(prefill_seq_lens, default=0),
            decode_seq_lens=decode_lens_t,
            decode_block_tables=decode_tables_t.view(len(decodes), decode_width),  # [n, max_blocks]
            max_decode_seq_len=max(decode_seq_lens, default=0),
            prefill_query_lens_host=query_lens,
            prefill_seq_lens_host=prefill_seq_lens,
            decode_seq_lens_host=decode_seq_lens,
            rope_lens=None if rope_lens is None else rope_t,
        )
        lora_token_slots = None
        row_slots = self._lora_row_slots(rows)
        if row_slots is not None:  # in packing order, as the tokens
            lora_token_slots = [row_slots[i] for i in prefills for _ in range(counts[i])]
            lora_token_slots += [row_slots[i] for i in decodes]
        return StepInputs(
            input_ids=ids_t,
            positions=positions_t,
            metadata=metadata,
            logits_indices=sampled_t,
            lora_token_slots=lora_token_slots,
        )

    def _lora_row_slots(self, rows: list[SeqState]) -> list[int] | None:
        """Each row's adapter slot (-1: the base model); None when no row has an adapter."""
        if self.lora is None or all(seq.request.lora_key is None for seq in rows):
            return None
        slot_of = self.lora.slot_of
        # an adapter whose activation failed this step has no slot: its rows run on the base
        # model and the engine discards them (it aborts that adapter's requests)
        return [-1 if seq.request.lora_key is None else slot_of.get(seq.request.lora_key, -1) for seq in rows]

    @torch.inference_mode()
    def execute(self, msg: StepMessage, kv_caches: list) -> SamplerOutput | None:
        self.batch.apply(msg)
        if self.static_decode is not None and msg.block_table_updates:
            seqs = self.batch.seqs  # the static path's host mirror rewrites changed tables from their start
            self.static_decode.note_table_changes(
                (seqs[seq_id].block_table, start) for seq_id, start, _ in msg.block_table_updates if seq_id in seqs
            )
        if not msg.seq_ids:
            return SamplerOutput([]) if self.sampler is not None else None
        rows = self.batch.rows(msg)
        _record_history(msg, rows)
        draft_probs = self.drafter.propose(msg, rows, self.batch) if self.drafter is not None else None
        # rows with adapters run eagerly (the static decode buckets hold no adapter slots)
        # and so do rows that score their prompt (prompt logprobs read every new token's hidden state)
        scored = pooling = ()
        if self.batch.num_full_prefill:
            scored = _prompt_scored_rows(msg, rows)
            pooling = [i for i, seq in enumerate(rows) if seq.request.params.pooling is not None]
        is_static = (self.static_decode is not None and not scored and not pooling
                     and (self.lora is None or all(s.request.lora_key is None for s in rows)))  # fmt: skip
        decode = decode_rows(
            msg, rows, self.block_size, self.rope_len_rule, expand_drafts=self.static_decode.expands_drafts
        ) if is_static else None  # fmt: skip
        if decode is not None and self.static_decode.fits(decode):
            hidden = self.static_decode.forward(decode, kv_caches)  # [num_decodes, hidden]
            logits_indices, self.last_path = _long(decode.sampled, self.device), f"static-{self.static_decode.last_path}"
        else:
            inputs = self.prepare(msg, rows)
            if self.attn_backend is not None:
                self.attn_backend.begin_step(inputs.metadata)  # checks and launch planning, once per step
            if self.lora is not None:
                self.lora.batch.set_step(inputs.lora_token_slots, self.device)
            try:
                hidden = self.model(inputs.input_ids, inputs.positions, kv_caches, inputs.metadata)  # [T, hidden]
            finally:
                if self.lora is not None:
                    self.lora.batch.clear()
            logits_indices, self.last_path = inputs.logits_indices, "eager"
        if self.rope_len_rule == ROPE_LEN_PER_SEQUENCE:
            _record_computed(msg, rows)
        scores = self._prompt_logprobs(msg, rows, scored, hidden) if scored else {}
        pooled = _pool(msg, rows, pooling, hidden) if pooling else {}
        if logits_indices.numel() == 0:  # only prefill chunks this step
            return SamplerOutput([], prompt_logprobs=scores, pooled=pooled) if self.sampler is not None else None
        logits = self.model.compute_logits(hidden.index_select(0, logits_indices))  # [num_sampled, vocab]
        if self.sampler is None:
            return None
        if msg.draft_seq_ids:
            out = self._sample_with_drafts(msg, rows, logits, draft_probs)
        else:
            out = self.sampler(logits, self.batch.sampling_batch(msg, rows))
        out.prompt_logprobs, out.pooled = scores, pooled
        return out

    def _prompt_logprobs(
        self, msg: StepMessage, rows: list[SeqState], scored: list[int], hidden: torch.Tensor
    ) -> dict[int, tuple[int, list[dict[int, float]]]]:
        """The scored rows' prompt logprobs from this step's hidden states [T, hidden] (eager
        packing: prefill rows' tokens first, then the one-token rows): the token at position
        p + 1 is scored by the logits at p, for every p this step computes below the prompt's
        last token."""
        packed = _packed_starts(msg.num_query_tokens)
        scores = {}
        for i in scored:
            seq, start = rows[i], msg.start_positions[i]
            prompt = seq.request.prompt_token_ids
            end = min(start + msg.num_query_tokens[i], len(prompt) - 1)  # positions p scored: [start, end)
            index = torch.arange(packed[i], packed[i] + end - start, device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, index))  # [end - start, vocab]
            top = prompt_logprobs(logits, prompt[start + 1 : end + 1], seq.request.params.prompt_logprobs)
            scores[seq.seq_id] = (start + 1, top)
        return scores

    def _sample_with_drafts(
        self, msg: StepMessage, rows: list[SeqState], logits: torch.Tensor, draft_probs: list | None = None
    ) -> SamplerOutput:
        """The plain rows sample as ever; each drafting row's 1 + k logits rows verify its
        drafts (Sampler.verify; `draft_probs`: per drafting row, a draft model's q of each
        draft). One SeqSample per sampled row, in row order."""
        drafts = dict(zip(msg.draft_seq_ids, msg.num_draft_tokens))
        unsampled = set(msg.unsampled_seq_ids)
        plain_rows, draft_rows, draft_tokens = [], [], []
        offset = 0
        for i, seq_id in enumerate(msg.seq_ids):
            end = offset + msg.num_query_tokens[i]
            if seq_id in unsampled:
                pass
            elif seq_id in drafts:
                k = drafts[seq_id]
                draft_rows.extend(range(len(plain_rows) + len(draft_rows), len(plain_rows) + len(draft_rows) + k + 1))
                draft_tokens.append(msg.token_ids[end - k : end])
            else:
                plain_rows.append(len(plain_rows) + len(draft_rows))
            offset = end
        plain = SamplerOutput([])
        if plain_rows:
            index = torch.tensor(plain_rows, device=logits.device)
            plain = self.sampler(logits.index_select(0, index), self.batch.sampling_batch(msg, rows, skip=drafts))
        verified = self.sampler.verify(
            logits.index_select(0, torch.tensor(draft_rows, device=logits.device)),
            self.batch.draft_sampling_batch(msg, rows, drafts),
            draft_tokens,
            draft_probs,
        )
        plain_samples, verified_samples = iter(plain.samples), iter(verified)
        samples = [
            next(verified_samples) if s in drafts else next(plain_samples) for s in msg.seq_ids if s not in unsampled
        ]
        return SamplerOutput(samples)


def _record_computed(msg: StepMessage, rows: list[SeqState]) -> None:
    """Each row's furthest computed position + 1 (what ROPE_LEN_PER_SEQUENCE reads)."""
    for seq, start, count in zip(rows, msg.start_positions, msg.num_query_tokens):
        seq.num_computed_max = max(seq.num_computed_max, start + count)


def _record_history(msg: StepMessage, rows: list[SeqState]) -> None:
    """The worker's copy of each token history (kept only where penalties need it) gains
    the step's tokens; a recomputed sequence starts over from its start position."""
    offset = 0
    for i, seq in enumerate(rows):
        count = msg.num_query_tokens[i]
        if seq.history is not None:
            del seq.history[msg.start_positions[i] :]
            seq.history.extend(msg.token_ids[offset : offset + count])
        offset += count


def _long(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _padded(tables: list[list[int]]) -> tuple[list[int], int]:
    """Block tables as one flat row-major list padded with block 0 to the longest, and its width."""
    width = max((len(t) for t in tables), default=0)
    return [block for t in tables for block in (t + [0] * (width - len(t)))], width


class StepStaging:
    """An eager step's input columns in one buffer: the int64 columns, then the int32 ones,
    each starting on a 16-byte boundary (so every pointer a kernel gets is aligned: Triton
    compiles a variant per alignment).

    On CUDA the buffer is written in pinned host memory, reused from step to step, and
    reaches the device in one non-blocking copy per step (an event says when the copy has
    read it, before the next step rewrites it); the columns are views of the device copy,
    a fresh allocation each step. Elsewhere (CPU) the buffer is the columns: no pinning,
    no copy. `copy=True` forces the copy path (tests)."""

    def __init__(self, device: torch.device | str, *, copy: bool | None = None) -> None:
        self.device = torch.device(device)
        self.is_copied = self.device.type == "cuda" if copy is None else copy
        self._pin = self.is_copied and self.device.type == "cuda"
        self._host: torch.Tensor | None = None  # int32 words, grown to the largest step
        self._copied = None  # CUDA event after the last copy
        self.num_copies = 0

    def stage(self, longs: list[list[int]], ints: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The columns on the device: int64 tensors for `longs`, int32 tensors for `ints`."""
        flat_long, long_at = _aligned(longs, 2)  # int64 elements: 2 per 16 bytes
        flat_int, int_at = _aligned(ints, 4)
        long_words = 2 * len(flat_long)
        words = long_words + len(flat_int)
        if self.is_copied:
            if self._copied is not None:
                self._copied.synchronize()  # the last step's copy has read the host buffer
            if self._host is None or self._host.numel() < words:
                self._host = torch.empty(max(words, 1024), dtype=torch.int32, pin_memory=self._pin)
            host = self._host[:words]
        else:
            host = torch.empty(words, dtype=torch.int32)
        host[:long_words].view(torch.int64).copy_(torch.tensor(flat_long, dtype=torch.int64))
        host[long_words:].copy_(torch.tensor(flat_int, dtype=torch.int32))
        buffer = host
        if self.is_copied:
            buffer = host.to(self.device, non_blocking=True, copy=True)  # [words] int32: one host-to-device copy
            self.num_copies += 1
            if self._pin:
                self._copied = self._copied or torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(self.device))
        long_view = buffer[:long_words].view(torch.int64)
        int_view = buffer[long_words:]
        return ([long_view[at : at + len(c)] for at, c in zip(long_at, longs)],
                [int_view[at : at + len(c)] for at, c in zip(int_at, ints)])  # fmt: skip


def _aligned(columns: list[list[int]], per_16_bytes: int) -> tuple[list[int], list[int]]:
    """The columns concatenated, each padded with zeros to a multiple of `per_16_bytes`
    elements; and where each starts."""
    flat: list[int] = []
    starts = []
    for column in columns:
        starts.append(len(flat))
        flat.extend(column)
        flat.extend([0] * (-len(column) % per_16_bytes))
    return flat, starts


def _pool(msg: StepMessage, rows: list[SeqState], pooling: list[int], hidden: torch.Tensor) -> dict[int, list[float]]:
    """Pooling rows: fold this step's final hidden states [T, hidden] into each request's
    pool (a chunk at position 0 starts it over: a recompute), and the pooled vector of
    each whose prompt ends this step."""
    packed = _packed_starts(msg.num_query_tokens)
    pooled = {}
    for i in pooling:
        seq, start, count = rows[i], msg.start_positions[i], msg.num_query_tokens[i]
        request = seq.request
        params = request.params.pooling
        states = hidden[packed[i] : packed[i] + count].float()  # [count, hidden]
        if params.pooling == "mean":
            total = states.sum(dim=0)
            request.pooled = total if start == 0 else request.pooled + total
        elif params.pooling == "cls" and start == 0:
            request.pooled = states[0]
        if start + count < request.num_prompt_tokens:
            continue
        if params.pooling == "last":
            vector = states[-1]
        elif params.pooling == "mean":
            vector = request.pooled / request.num_prompt_tokens
        else:
            vector = request.pooled
        vector = vector[: params.dimensions]  # [dimensions]: Matryoshka truncation, then the norm
        if params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        pooled[seq.seq_id] = vector.tolist()
        request.pooled = None
    return pooled


def _prompt_scored_rows(msg: StepMessage, rows: list[SeqState]) -> list[int]:
    """Rows that asked for prompt logprobs and compute a position before their prompt's last."""
    return [
        i for i, seq in enumerate(rows)
        if seq.request.prompt_token_ids is not None and msg.start_positions[i] < seq.request.num_prompt_tokens - 1
    ]  # fmt: skip


def _packed_starts(counts: list[int]) -> list[int]:
    """Each row's first token's place in an eager step's packing (ModelRunner.prepare):
    rows of more than one token first, in row order, then the one-token rows."""
    starts = [0] * len(counts)
    at = 0
    for i, n in enumerate(counts):
        if n > 1:
            starts[i], at = at, at + n
    for i, n in enumerate(counts):
        if n == 1:
            starts[i], at = at, at + 1
    return starts
