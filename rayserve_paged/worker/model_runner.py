"""SchedulerOutput -> model inputs -> logits -> samples, for one tensor-parallel rank.

The step's tokens are packed prefill-first (see ops/attention.py); `logits_indices` picks
each scheduled sequence's last new token, in SchedulerOutput order, for the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayserve_paged.core.outputs import ScheduledSeq, SchedulerOutput
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.models.sampler import Sampler, SamplerOutput
from rayserve_paged.ops.attention import AttentionMetadata
from rayserve_paged.worker.static_decode import StaticDecode, decode_rows


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64: last new token of each sampled seq


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
        self.params: dict[str, SamplingParams] = {}  # request id -> its sampling parameters
        self.static_decode = static_decode  # decode-only steps within its buckets: padded, CUDA graphs
        self.last_path = ""  # the last step's: "eager", "static-graph" or "static-eager" (padded, no graph)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        seqs = [s for g in out.groups for s in g.seqs]
        prefills = [s for s in seqs if len(s.token_ids) > 1]
        decodes = [s for s in seqs if len(s.token_ids) == 1]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_index: dict[int, int] = {}
        for s in prefills + decodes:
            table = s.block_table
            for pos in range(s.start_pos, s.start_pos + len(s.token_ids)):
                slots.append(table[pos // bs] * bs + pos % bs)
            positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
            input_ids.extend(s.token_ids)
            last_index[s.seq_id] = len(input_ids) - 1
        device = self.device
        query_lens = [len(s.token_ids) for s in prefills]
        prefill_seq_lens = [s.start_pos + n for s, n in zip(prefills, query_lens)]
        decode_seq_lens = [s.start_pos + 1 for s in decodes]
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        metadata = AttentionMetadata(
            slot_mapping=_long(slots, device),
            num_prefill_tokens=query_start[-1],
            num_decode_tokens=len(decodes),
            block_size=bs,
            prefill_query_start_loc=_int(query_start, device),
            prefill_context_lens=_int([s.start_pos for s in prefills], device),
            prefill_seq_lens=_int(prefill_seq_lens, device),
            prefill_block_tables=_block_tables(prefills, device),
            max_prefill_query_len=max(query_lens, default=0),
            max_prefill_seq_len=max(prefill_seq_lens, default=0),
            decode_seq_lens=_int(decode_seq_lens, device),
            decode_block_tables=_block_tables(decodes, device),
            max_decode_seq_len=max(decode_seq_lens, default=0),
            prefill_query_lens_host=query_lens,
            prefill_seq_lens_host=prefill_seq_lens,
            decode_seq_lens_host=decode_seq_lens,
        )
        return StepInputs(
            input_ids=_long(input_ids, device),
            positions=_long(positions, device),
            metadata=metadata,
            # a prefill chunk that ends before the group's last token samples nothing
            logits_indices=_long([last_index[s.seq_id] for g in out.groups if g.do_sample for s in g.seqs], device),
        )

    def _group_params(self, out: SchedulerOutput) -> list[SamplingParams]:
        """Parameters arrive with a request's first step and stay until it finishes."""
        for request_id in out.finished_request_ids:
            self.params.pop(request_id, None)
        params = self.params
        for g in out.groups:
            if g.sampling_params is not None:
                params[g.request_id] = g.sampling_params
        return [params[g.request_id] for g in out.groups]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv_caches: list) -> SamplerOutput | None:
        group_params = self._group_params(out)
        if not out.groups:
            return SamplerOutput([]) if self.sampler is not None else None
        rows = decode_rows(out, self.block_size) if self.static_decode is not None else None
        if self.static_decode is not None and self.static_decode.fits(rows):
            hidden = self.static_decode.forward(rows, kv_caches)  # [num_decodes, hidden]
            logits_indices, self.last_path = _long(rows.sampled, self.device), f"static-{self.static_decode.last_path}"
        else:
            inputs = self.prepare(out)
            if self.attn_backend is not None:
                self.attn_backend.begin_step(inputs.metadata)  # checks and launch planning, once per step
            hidden = self.model(inputs.input_ids, inputs.positions, kv_caches, inputs.metadata)  # [T, hidden]
            logits_indices, self.last_path = inputs.logits_indices, "eager"
        sampled = [(g, p) for g, p in zip(out.groups, group_params) if g.do_sample]
        if not sampled:  # only prefill chunks this step
            return SamplerOutput([]) if self.sampler is not None else None
        logits = self.model.compute_logits(hidden.index_select(0, logits_indices))  # [num_sampled, vocab]
        if self.sampler is None:
            return None
        return self.sampler(logits, [g for g, _ in sampled], [p for _, p in sampled])


def _long(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _int(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _block_tables(seqs: list[ScheduledSeq], device) -> torch.Tensor:
    width = max((len(s.block_table) for s in seqs), default=0)
    rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(seqs), width)  # [n, max_blocks]
