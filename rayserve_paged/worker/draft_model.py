"""Speculative decoding with a draft model (speculative_config method "draft_model"): a small
model of the target's tokenizer, run by the same worker (tensor_parallel_size 1), proposes
each drafting row's k drafts at the start of the step that verifies them.

Its KV lives in a pool of its own, indexed by the target's block tables and slots: the same
block ids, block size and number of blocks, with the draft's layer and head shapes. So the
block manager, the scheduler's lookahead slots and `roll_back` serve both models, and every
swap, copy-on-write and tier move of a block is applied to both pools with the same lists.

A step, on the worker, before the target's forward:

    step rows        prefill chunk   [p0 .. p7]        decode [t]     drafting [t  _  _  _ ]
    draft pass 1     [p0 .. p7]                        [t]            [t] -> d1            (all rows, one forward)
    draft pass 2..k                                                   [d1] -> d2, [d2] -> d3
    draft pass k+1                                                    [d3]  (K/V only: d3 may be accepted)
    target           [p0 .. p7]                        [t]            [t d1 d2 d3] -> verify

The draft sees every token the target sees (pass 1 runs over the step's own rows, a
drafting row cut to its last real token), and writes K/V for the drafts into the row's
lookahead slots, where the target writes its own; whatever verification accepts has the
draft's K/V too, and rejected slots are overwritten by later tokens in both pools.
Proposals are drawn by the request's own sampling rule (Sampler.propose): greedy rows take
the draft's argmax, the others draw from its distribution q, which verification reads
(accept with min(1, p/q), resample from max(0, p - q)).

Nothing here loads or compiles at step time: the model is loaded, and its attention kernel
variants compiled, at engine start (Worker.load_model, Worker.warm_up).
"""

from __future__ import annotations

import torch

from rayserve_paged.core.outputs import StepMessage
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.models.loader import ModelConfig
from rayserve_paged.models.sampler import Sampler
from rayserve_paged.ops.cache_ops import BlockSwapper
from rayserve_paged.worker.input_batch import InputBatch, RequestState, SeqState
from rayserve_paged.worker.model_runner import ModelRunner


def check_draft_model(target: ModelConfig, draft: ModelConfig, max_model_len: int) -> None:
    """A draft model must share the target's vocabulary and cover its context length."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model's vocabulary ({draft.vocab_size} tokens) differs from the "
            f"target model's ({target.vocab_size} tokens); a draft model must use the target's tokenizer"
        )
    if draft.max_model_len < max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft model's context ({draft.max_model_len} tokens) is shorter than "
            f"max_model_len ({max_model_len}); set max_model_len to at most {draft.max_model_len}"
        )


class DraftModel:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, block_size: int, device: torch.device,
                 attn_backend, sampler: Sampler) -> None:  # fmt: skip
        self.model = model
        self.model_config = model_config
        # the draft's inputs, packed as the target's (its own RoPE rule and staging buffer)
        self.runner = ModelRunner(model, block_size, device, None, attn_backend)
        self.sampler = sampler
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # per draft layer, the target's block ids
        self.cpu_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.swapper = BlockSwapper([], [])

    def set_caches(self, kv_caches: list, cpu_caches: list) -> None:
        self.kv_caches, self.cpu_caches = kv_caches, cpu_caches
        self.swapper = BlockSwapper(kv_caches, cpu_caches)

    def move_blocks(self, msg: StepMessage) -> None:
        """The step's swaps and copies, on the draft's pools (the worker's order: finish,
        swap out, swap in, copy)."""
        self.swapper.move(msg.blocks_to_swap_out, msg.blocks_to_swap_in, msg.blocks_to_copy)

    @torch.inference_mode()
    def propose(self, msg: StepMessage, rows: list[SeqState], batch: InputBatch) -> list[list[torch.Tensor | None]]:
        """Run the draft over the step's tokens, then draw each drafting row's k drafts into
        the row's placeholder tokens in `msg.token_ids`. Returns, per drafting row (in row
        order) and draft, the distribution q it was drawn from (None: greedy, a point mass)."""
        drafts = dict(zip(msg.draft_seq_ids, msg.num_draft_tokens))
        hidden, sampled = self._forward(_observed(msg, rows, drafts), rows)  # pass 1: every row
        if not drafts:
            return []
        drafting = [i for i, s in enumerate(msg.seq_ids) if s in drafts]
        offsets = _row_offsets(msg.num_query_tokens)
        max_k = max(drafts.values())
        probs: list[list[torch.Tensor | None]] = [[] for _ in drafting]
        live = list(range(len(drafting)))  # drafting rows (indices into `drafting`) with drafts to draw
        for j in range(max_k):
            logits = self.model.compute_logits(hidden.index_select(0, sampled))  # [len(live), vocab]
            tokens, q = self.sampler.propose(logits, batch.draft_sampling_batch(msg, rows, drafts, position=j))
            for n, d in enumerate(live):
                i = drafting[d]
                msg.token_ids[offsets[i] + 1 + j] = tokens[n]
                probs[d].append(q[n])
            # the next pass feeds the new drafts: every row's, including one that drew its
            # last (its K/V, in case verification accepts it); only rows with more to draw sample
            fed = [drafting[d] for d in live]
            view = StepMessage(
                seq_ids=[msg.seq_ids[i] for i in fed],
                start_positions=[msg.start_positions[i] + 1 + j for i in fed],
                num_query_tokens=[1] * len(fed),
                token_ids=[msg.token_ids[offsets[i] + 1 + j] for i in fed],
                unsampled_seq_ids=[msg.seq_ids[i] for i in fed if drafts[msg.seq_ids[i]] == j + 1],
            )
            hidden, sampled = self._forward(view, [rows[i] for i in fed])
            live = [d for d in live if drafts[msg.seq_ids[drafting[d]]] > j + 1]
        return probs

    def warm_up(self) -> list[str]:
        """Before serving: the attention kernel variants of the draft's shapes, and one
        decode pass (what a first forward decides and builds, it does now). The pass writes
        slot 0 of the draft's pool, which any token placed there overwrites before it is read."""
        mc = self.model_config
        backend = self.runner.attn_backend
        qkv_stride = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
        compiled = backend.warm_up(*self.kv_caches[0], mc.num_heads, qkv_stride)
        probe = StepMessage(seq_ids=[0], start_positions=[0], num_query_tokens=[1], token_ids=[0])
        request = RequestState("draft-warm-up", SamplingParams(), None, 1)
        hidden, sampled = self._forward(probe, [SeqState(0, request, [0], 0, None)])
        self.model.compute_logits(hidden.index_select(0, sampled))
        return compiled

    def _forward(self, view: StepMessage, rows: list[SeqState]) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's forward over `view`'s rows, writing their K/V: (hidden [T, hidden],
        the packed indices of the sampled rows' last tokens)."""
        inputs = self.runner.prepare(view, rows)
        self.runner.attn_backend.begin_step(inputs.metadata)  # checks and launch planning, once per pass
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)  # [T, hidden]
        return hidden, inputs.logits_indices


def _observed(msg: StepMessage, rows: list[SeqState], drafts: dict[int, int]) -> StepMessage:
    """The step's rows as the draft's first pass runs them: each drafting row cut to its
    first (last real) token; only the drafting rows sample."""
    if not drafts:
        return StepMessage(seq_ids=msg.seq_ids, start_positions=msg.start_positions,
                           num_query_tokens=msg.num_query_tokens, token_ids=msg.token_ids,
                           unsampled_seq_ids=msg.seq_ids)  # fmt: skip
    counts, tokens = [], []
    offset = 0
    for seq_id, count in zip(msg.seq_ids, msg.num_query_tokens):
        kept = 1 if seq_id in drafts else count
        counts.append(kept)
        tokens.extend(msg.token_ids[offset : offset + kept])
        offset += count
    return StepMessage(seq_ids=msg.seq_ids, start_positions=msg.start_positions, num_query_tokens=counts,
                       token_ids=tokens, unsampled_seq_ids=[s for s in msg.seq_ids if s not in drafts])  # fmt: skip


def _row_offsets(counts: list[int]) -> list[int]:
    """Row i's first token's index in the message's token_ids."""
    offsets = [0] * len(counts)
    at = 0
    for i, n in enumerate(counts):
        offsets[i], at = at, at + n
    return offsets
