"""From last-token logits to sampled tokens: greedy, sampling (temperature, top-k, top-p,
min-p, penalties, per-request seeds), logprobs, and beam-search candidates.

Logprobs are the model's own (log-softmax of the raw logits), as OpenAI reports them;
beam search and best_of rank by their sums.

Seeded sampling draws each token with a generator seeded from (seed, the sequence's place
in its group, its output index), so a seeded request samples the same tokens whatever else
shares the batch. Sampling uses the exponential race: argmax(p / q) with q ~ Exp(1) picks
token i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayserve_paged.core.outputs import ScheduledGroup, compact_pickle
from rayserve_paged.core.sequence import SamplingParams

_MASK = float("-inf")


@compact_pickle
@dataclass(slots=True)
class SeqSample:
    seq_id: int
    token_ids: list[int]  # 1 token; best_of tokens on a group's first step; beam candidates
    logprobs: list[float]  # the model's logprob of each token
    top_logprobs: list[dict[int, float]] | None = None  # per token: its top-k alternatives


@compact_pickle
@dataclass(slots=True)
class SamplerOutput:
    samples: list[SeqSample]  # one per scheduled sequence, in SchedulerOutput order


@dataclass(slots=True)
class _Row:
    """One draw: a logits row and what decides how it is drawn."""

    row: int
    seed: int | None
    sample_index: int
    output_index: int


def _mix_seed(seed: int, sample_index: int, output_index: int) -> int:
    x = (seed * 0x9E3779B1 + sample_index * 0x85EBCA77 + output_index * 0xC2B2AE3D) & ((1 << 63) - 1)
    return x ^ (x >> 29)


class Sampler:
    def __init__(self, num_eos_tokens: int = 1, eos_token_ids: tuple[int, ...] = ()) -> None:
        # Beam search keeps (1 + #eos) * width candidates (at least 2 * width) per step, so
        # width of them survive even when the best all end in an EOS.
        self.beam_factor = max(2, 1 + num_eos_tokens)
        self.eos_token_ids = tuple(eos_token_ids)  # masked before a request's min_tokens

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, groups: list[ScheduledGroup], group_params: list[SamplingParams]
    ) -> SamplerOutput:
        """`group_params[i]` samples `groups[i]` (workers keep each request's parameters)."""
        logits = logits.float()  # [num_seqs, vocab]
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_seqs, vocab]
        samples: list[SeqSample] = []
        draws: list[_Row] = []  # non-beam rows to draw, expanded for best_of
        owners: list[tuple[int, int]] = []  # (samples index, copies) for each draw group
        row_params = [p for g, p in zip(groups, group_params) for _ in g.seqs]  # per logits row
        row = 0
        penalised = self._apply_penalties(logits, groups, group_params)
        penalised = self._apply_logit_controls(penalised, groups, group_params)
        for group, params in zip(groups, group_params):
            for seq in group.seqs:
                if params.use_beam_search:
                    samples.append(self._beam_candidates(seq.seq_id, raw_logprobs[row], params.best_of))
                else:
                    copies = params.best_of if group.is_first_step else 1
                    owners.append((len(samples), copies))
                    samples.append(SeqSample(seq.seq_id, [], []))
                    for i in range(copies):
                        index = i if group.is_first_step else seq.sample_index
                        draws.append(_Row(row, params.seed, index, seq.num_output_tokens))
                row += 1
        if draws:
            tokens = self._draw(penalised, draws, row_params)
            self._fill(samples, owners, draws, tokens, raw_logprobs, row_params)
        return SamplerOutput(samples)

    # ------------------------------------------------------------------ penalties

    def _apply_penalties(self, logits: torch.Tensor, groups: list[ScheduledGroup], group_params) -> torch.Tensor:
        rows = []
        row = 0
        for group, params in zip(groups, group_params):
            for seq in group.seqs:
                if seq.history is not None and not params.use_beam_search:
                    rows.append((row, group, params, seq))
                row += 1
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for row, group, p, seq in rows:
            history = torch.tensor(seq.history, dtype=torch.long, device=logits.device)
            output = history[group.num_prompt_tokens :]
            counts = torch.bincount(output.clamp(0, vocab - 1), minlength=vocab).to(logits.dtype)  # [vocab]
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                seen[history.clamp(0, vocab - 1)] = True
                x = logits[row]
                penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
                logits[row] = torch.where(seen, penalised, x)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _apply_logit_controls(self, logits: torch.Tensor, groups: list[ScheduledGroup], group_params) -> torch.Tensor:
        """logit_bias added to its tokens; EOS and stop tokens masked while a sequence has
        fewer than min_tokens output tokens. Only rows that ask are touched."""
        rows = []
        row = 0
        for group, params in zip(groups, group_params):
            for seq in group.seqs:
                is_short = seq.num_output_tokens < params.min_tokens
                if (params.logit_bias or is_short) and not params.use_beam_search:
                    rows.append((row, params, is_short))
                row += 1
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for row, params, is_short in rows:
            if params.logit_bias:
                ids = [t for t in params.logit_bias if t < vocab]
                bias = torch.tensor([params.logit_bias[t] for t in ids], dtype=logits.dtype, device=logits.device)
                logits[row, ids] += bias
            if is_short:
                banned = [t for t in (*self.eos_token_ids, *params.stop_token_ids) if t < vocab]
                logits[row, banned] = float("-inf")
        return logits

    # ------------------------------------------------------------------ drawing

    def _draw(self, logits: torch.Tensor, draws: list[_Row], row_params: list) -> list[int]:
        index = torch.tensor([d.row for d in draws], device=logits.device)
        x = logits.index_select(0, index)  # [num_draws, vocab]
        params = [row_params[d.row] for d in draws]
        greedy = [p.is_greedy for p in params]
        result = torch.empty(len(draws), dtype=torch.long, device=logits.device)
        if any(greedy):
            g = torch.tensor(greedy, device=logits.device)
            result[g] = x[g].argmax(dim=-1)
        if all(greedy):
            return result.tolist()
        sampled = [i for i, is_g in enumerate(greedy) if not is_g]
        s_index = torch.tensor(sampled, device=logits.device)
        probs = self._truncated_probs(x[s_index], [params[i] for i in sampled])  # [num_sampled, vocab]
        q = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            d = draws[i]
            if d.seed is None:
                q[j].exponential_()
            else:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(_mix_seed(d.seed, d.sample_index, d.output_index))
                q[j].exponential_(generator=gen)
        result[s_index] = (probs / q).argmax(dim=-1)
        return result.tolist()

    def _truncated_probs(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        logits = logits / temperature
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k != -1 for k in top_k) or any(p < 1.0 for p in top_p):
            vocab = logits.shape[-1]
            k = torch.tensor([vocab if k == -1 else min(k, vocab) for k in top_k], device=device)
            sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, vocab]
            ranks = torch.arange(vocab, device=device).unsqueeze(0)
            drop = ranks >= k.unsqueeze(1)
            # top-p is measured on what top-k leaves (as HF's warpers and vLLM do): keep the
            # smallest prefix whose mass reaches top_p (the first token always stays)
            sorted_probs = sorted_logits.masked_fill(drop, _MASK).softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= torch.tensor(top_p, device=device).unsqueeze(1)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, _MASK)
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            threshold = torch.tensor(min_p, device=device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    # ------------------------------------------------------------------ results

    def _fill(self, samples, owners, draws, tokens, raw_logprobs, row_params) -> None:
        device = raw_logprobs.device
        rows = torch.tensor([d.row for d in draws], device=device)
        chosen = raw_logprobs[rows, torch.tensor(tokens, device=device)].tolist()  # one gather
        d = 0
        for sample_index, copies in owners:
            sample = samples[sample_index]
            for _ in range(copies):
                draw = draws[d]
                sample.token_ids.append(tokens[d])
                sample.logprobs.append(chosen[d])
                k = row_params[draw.row].logprobs
                if k is not None:
                    if sample.top_logprobs is None:
                        sample.top_logprobs = []
                    sample.top_logprobs.append(_top_logprobs(raw_logprobs[draw.row], tokens[d], chosen[d], k))
                d += 1

    def _beam_candidates(self, seq_id: int, logprobs: torch.Tensor, width: int) -> SeqSample:
        """The best beam_factor * width continuations of one beam, best first."""
        values, indices = logprobs.topk(min(self.beam_factor * width, logprobs.shape[-1]))
        return SeqSample(seq_id, indices.tolist(), values.tolist())


def _top_logprobs(logprobs: torch.Tensor, token: int, token_logprob: float, k: int) -> dict[int, float]:
    """The sampled token's logprob and the k most likely tokens' (OpenAI's top_logprobs)."""
    top = {}
    if k > 0:
        values, indices = logprobs.topk(k)
        top = dict(zip(indices.tolist(), values.tolist()))
    top[token] = token_logprob
    return top
