"""From last-token logits to sampled tokens: greedy, sampling (temperature, top-k, top-p,
min-p, penalties, per-request seeds), logprobs, and beam-search candidates.

The sampler knows tensors and per-row parameter columns (`SamplingBatch`), not requests or
sequences: the worker builds the batch (worker/sampling_inputs.py).

Logprobs are the model's own (log-softmax of the raw logits), as OpenAI reports them;
beam search and best_of rank by their sums.

Seeded sampling draws each token with a generator seeded from (seed, the sequence's place
in its group, its output index), so a seeded request samples the same tokens whatever else
shares the batch. Sampling uses the exponential race: argmax(p / q) with q ~ Exp(1) picks
token i with probability p_i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rayserve_paged.pickling import compact_pickle

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
    samples: list[SeqSample]  # one per logits row, in row order
    # LoRA adapters (keys) this step could not put into their slot, with the reason: the
    # engine aborts their requests (whose rows here ran without the adapter)
    lora_failures: list[tuple[tuple, str]] = field(default_factory=list)
    # rows that asked for prompt logprobs and computed prompt tokens this step: seq id ->
    # (position p of the first prompt token scored, per token p, p+1, ...: its logprob and
    # the top-k alternatives'), from the logits of the token before it
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # pooling requests whose prompt ended this step: seq id -> the pooled vector
    pooled: dict[int, list[float]] = field(default_factory=dict)


@dataclass(slots=True)
class RowPenalty:
    """The penalties of one row and the tokens they count."""

    history: Sequence[int] | torch.Tensor  # every token id of the sequence: prompt, then output
    num_prompt_tokens: int  # frequency and presence count only what follows the prompt
    repetition: float  # 1.0: off; applies to prompt and output tokens
    frequency: float
    presence: float


@dataclass(slots=True)
class SamplingBatch:
    """How to sample one step's logits: one entry per logits row, in row order.

    Columns are lists or tuples with one value per row. Controls that few rows use are
    sparse (row -> value, only for the rows that ask). A beam row (beam width > 0) reads
    only its seq id, width and nothing else: it returns the best beam_factor * width
    continuations. The flags below are derived once, at construction, from the columns
    (C-speed scans); they pick the sampler's branches, and the common step (every row
    greedy, one draw, no logprobs, no controls) costs one argmax and one gather.
    """

    seq_ids: Sequence[int]
    temperatures: Sequence[float]  # 0.0: greedy (argmax)
    top_ks: Sequence[int]  # -1: the whole vocabulary
    top_ps: Sequence[float]  # 1.0: off
    min_ps: Sequence[float]  # 0.0: off
    seeds: Sequence[int | None]  # None: the global generator
    sample_indices: Sequence[int]  # draw j of row r is seeded by sample index sample_indices[r] + j
    output_indices: Sequence[int]  # output tokens the row's sequence has so far
    num_draws: Sequence[int]  # best_of on a group's first step, else 1
    beam_widths: Sequence[int]  # 0: not beam search
    logprobs: Sequence[int | None]  # k: report the k most likely alternatives too
    penalties: dict[int, RowPenalty] = field(default_factory=dict)
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)  # row -> {token: added}
    banned_tokens: dict[int, Sequence[int]] = field(default_factory=dict)  # row -> masked tokens (min_tokens)
    # constrained rows (structured outputs): row i of token_bitmask ([k, ceil(vocab / 32)]
    # int32, bit j of word w = token 32 * w + j allowed) belongs to logits row
    # token_bitmask_rows[i]; tokens past the bitmask's end are not allowed
    token_bitmask_rows: Sequence[int] = ()
    token_bitmask: torch.Tensor | None = None

    is_all_greedy: bool = field(init=False)
    has_top_k_or_p: bool = field(init=False)
    has_min_p: bool = field(init=False)
    has_seeds: bool = field(init=False)
    has_logprobs: bool = field(init=False)
    has_beams: bool = field(init=False)
    has_multi_draws: bool = field(init=False)
    has_controls: bool = field(init=False)  # penalties, logit_bias, banned tokens or a bitmask on some row
    is_plain_greedy: bool = field(init=False)  # the fast path: argmax + gather, nothing else

    def __post_init__(self) -> None:
        n = len(self.seq_ids)
        for name in ("temperatures", "top_ks", "top_ps", "min_ps", "seeds", "sample_indices", "output_indices",
                     "num_draws", "beam_widths", "logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"SamplingBatch.{name} has {len(getattr(self, name))} rows, seq_ids has {n}")
        self.is_all_greedy = not any(self.temperatures)
        self.has_top_k_or_p = n > 0 and (self.top_ks.count(-1) != n or min(self.top_ps) < 1.0)
        self.has_min_p = any(self.min_ps)
        self.has_seeds = self.seeds.count(None) != n
        self.has_logprobs = self.logprobs.count(None) != n
        self.has_beams = any(self.beam_widths)
        self.has_multi_draws = n > 0 and max(self.num_draws) > 1
        self.has_controls = bool(self.penalties or self.logit_bias or self.banned_tokens or self.token_bitmask_rows)
        self.is_plain_greedy = self.is_all_greedy and not (
            self.has_logprobs or self.has_beams or self.has_multi_draws or self.has_controls
        )

    def __len__(self) -> int:
        return len(self.seq_ids)


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


DRAFT_SALT = 0x5DEECE66D  # a draft model's draws: a seeded row's generator apart from verification's


def _seeded_generator(seed: int | None, sample_index: int, output_index: int, device: torch.device,
                      salt: int = 0) -> torch.Generator | None:
    """A seeded draw's generator for its sample and output index (None: the global one)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(_mix_seed(seed, sample_index, output_index) ^ salt)
    return gen


def _generator(batch: SamplingBatch, row: int, device: torch.device, salt: int = 0) -> torch.Generator | None:
    """A row's generator (None: unseeded, the global one)."""
    return _seeded_generator(batch.seeds[row], batch.sample_indices[row], batch.output_indices[row], device, salt)


def _residual(p: torch.Tensor, draft: int, q: torch.Tensor | None) -> torch.Tensor:
    """max(0, p - q), what a rejected draft is redrawn from (the exponential race needs no
    normalising); q None: a point mass on `draft`. Where p <= q everywhere (p == q up to
    rounding: a rejection there has probability 0), p itself."""
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
        return residual
    residual = (p - q).clamp_(min=0.0)
    return residual if bool(residual.sum() > 0) else p


class Sampler:
    def __init__(self, num_eos_tokens: int = 1, eos_token_ids: tuple[int, ...] = ()) -> None:
        # Beam search keeps (1 + #eos) * width candidates (at least 2 * width) per step, so
        # width of them survive even when the best all end in an EOS.
        self.beam_factor = max(2, 1 + num_eos_tokens)
        # The model's EOS ids: whoever builds this sampler's batches bans them before a
        # request's min_tokens (SamplingBatch.banned_tokens).
        self.eos_token_ids = tuple(eos_token_ids)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """`batch` describes `logits`' rows, in order: one SeqSample per row."""
        if logits.shape[0] != len(batch):
            raise ValueError(f"the sampler got {logits.shape[0]} logits rows for a SamplingBatch of {len(batch)}")
        logits = logits.float()  # [num_rows, vocab]
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab]
        if batch.is_plain_greedy:
            return _plain_greedy(logits, raw_logprobs, batch.seq_ids)
        if batch.is_all_greedy and not (batch.has_logprobs or batch.has_beams or batch.has_multi_draws):
            # greedy rows with controls only (penalties, biases, bitmasks): argmax of the
            # controlled logits, the model's own logprobs
            return _plain_greedy(self._apply_controls(logits, batch), raw_logprobs, batch.seq_ids)
        samples: list[SeqSample] = []
        draws: list[_Row] = []  # non-beam rows to draw, expanded for best_of
        owners: list[tuple[int, int]] = []  # (samples index, copies) for each draw group
        penalised = self._apply_controls(logits, batch)
        seeds, sample_indices, output_indices = batch.seeds, batch.sample_indices, batch.output_indices
        for row, (seq_id, width, copies) in enumerate(zip(batch.seq_ids, batch.beam_widths, batch.num_draws)):
            if width:
                samples.append(self._beam_candidates(seq_id, raw_logprobs[row], width))
                continue
            owners.append((len(samples), copies))
            samples.append(SeqSample(seq_id, [], []))
            first = sample_indices[row]
            for j in range(copies):
                draws.append(_Row(row, seeds[row], first + j, output_indices[row]))
        if draws:
            tokens = self._draw(penalised, draws, batch)
            self._fill(samples, owners, draws, tokens, raw_logprobs, batch.logprobs)
        return SamplerOutput(samples)

    # ------------------------------------------------------------------ speculative decoding

    @torch.inference_mode()
    def propose(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[torch.Tensor | None]]:
        """A draft model's proposals: one token per row of `logits` (the draft's), drawn as
        the row's request samples: greedy rows take the argmax; the others draw from q, the
        draft's distribution after the row's logit_bias, temperature, top-k / top-p and
        min-p. Returns the tokens and, per row, q ([vocab]; None for a greedy row, whose
        verification compares argmaxes). A seeded row draws from a generator of its own
        output index apart from verification's (DRAFT_SALT): the draft's draw and the
        acceptance test must be independent."""
        controlled = self._apply_controls(logits.float(), batch)  # [rows, vocab]
        tokens = controlled.argmax(dim=-1).tolist()
        probs: list[torch.Tensor | None] = [None] * len(batch)
        temperatures = batch.temperatures
        sampled = [r for r, t in enumerate(temperatures) if t != 0.0]
        if not sampled:
            return tokens, probs
        q = self._sampled_probs(controlled, batch, sampled)  # [num_sampled, vocab]
        for j, r in enumerate(sampled):
            race = torch.empty_like(q[j]).exponential_(generator=_generator(batch, r, logits.device, DRAFT_SALT))
            tokens[r] = int((q[j] / race).argmax())
            probs[r] = q[j]
        return tokens, probs

    @torch.inference_mode()
    def verify(
        self, logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]],
        draft_probs: list[list[torch.Tensor | None]] | None = None,
    ) -> list[SeqSample]:
        """Verify drafts: each entry of `drafts` (k tokens) owns the next 1 + k rows of
        `logits` and `batch` (row j: the distribution p after its j-th draft). Returns one
        SeqSample per entry: the accepted drafts, then one token more. `draft_probs`, per
        entry and draft, the distribution q the draft was drawn from ([vocab], a draft
        model's); None (or no `draft_probs`): a deterministic proposal (n-gram drafts, or a
        greedy draft model's), q all on the draft.

        Greedy: drafts are accepted while each equals the argmax, and the token after them
        is the argmax: exactly what decoding one token at a time gives. Sampling: the
        rejection rule, one for both kinds of draft: accept draft d with probability
        min(1, p(d) / q(d)); a rejected draft is replaced by a draw from the residual
        max(0, p - q) normalised (for a point mass: p with the draft's token zeroed). Each
        position's output token is then distributed as p, as without drafts. A seeded row
        draws position j from the generator of output index output_indices[row] (the
        uniform first, then the exponential race), so a seeded request repeats itself."""
        logits = logits.float()  # [rows, vocab]
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        controlled = self._apply_controls(logits, batch)
        argmax = controlled.argmax(dim=-1).tolist()
        temperatures = batch.temperatures
        sampled = [r for r, t in enumerate(temperatures) if t != 0.0]
        probs = dict(zip(sampled, self._sampled_probs(controlled, batch, sampled))) if sampled else {}
        samples = []
        row = 0
        for entry, draft in enumerate(drafts):
            tokens: list[int] = []
            for j in range(len(draft) + 1):
                r = row + j
                if temperatures[r] == 0.0:
                    token = argmax[r]
                    tokens.append(token)
                    if j == len(draft) or token != draft[j]:
                        break
                    continue
                gen = _generator(batch, r, logits.device)
                p = probs[r]
                if j < len(draft):
                    d = draft[j]
                    q = None if draft_probs is None else draft_probs[entry][j]
                    q_d = 1.0 if q is None else float(q[d])
                    if torch.rand((), generator=gen, device=logits.device) * q_d < p[d]:
                        tokens.append(d)
                        continue
                    p = _residual(p, d, q)
                race = torch.empty_like(p).exponential_(generator=gen)
                tokens.append(int((p / race).argmax()))
                break
            rows = range(row, row + len(tokens))
            chosen = [float(raw_logprobs[r, t]) for r, t in zip(rows, tokens)]
            sample = SeqSample(batch.seq_ids[row], tokens, chosen)
            k = batch.logprobs[row]
            if k is not None:
                sample.top_logprobs = [_top_logprobs(raw_logprobs[r], t, c, k) for r, t, c in zip(rows, tokens, chosen)]
            samples.append(sample)
            row += len(draft) + 1
        return samples

    def _sampled_probs(self, controlled: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        """The truncated distributions ([len(rows), vocab]) of the given rows of `controlled`."""
        return self._truncated_probs(
            controlled.index_select(0, torch.tensor(rows, device=controlled.device)),
            [batch.temperatures[r] for r in rows],
            [batch.top_ks[r] for r in rows] if batch.has_top_k_or_p else None,
            [batch.top_ps[r] for r in rows] if batch.has_top_k_or_p else None,
            [batch.min_ps[r] for r in rows] if batch.has_min_p else None,
        )

    # ------------------------------------------------------------------ penalties and controls

    def _apply_controls(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Penalties, then logit_bias added to its tokens, then the token bitmasks of the
        constrained rows, then the banned tokens (EOS and stop tokens before min_tokens)
        masked, except on a constrained row where they are all its grammar allows (the
        grammar wins). Only the rows that ask are touched."""
        if not batch.has_controls:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for row, p in batch.penalties.items():
            history = torch.as_tensor(p.history, dtype=torch.long, device=logits.device)
            output = history[p.num_prompt_tokens :]
            counts = torch.bincount(output.clamp(0, vocab - 1), minlength=vocab).to(logits.dtype)  # [vocab]
            if p.repetition != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                seen[history.clamp(0, vocab - 1)] = True
                x = logits[row]
                penalised = torch.where(x > 0, x / p.repetition, x * p.repetition)
                logits[row] = torch.where(seen, penalised, x)
            logits[row] -= p.frequency * counts + p.presence * (counts > 0).to(logits.dtype)
        for row, logit_bias in batch.logit_bias.items():
            ids = [t for t in logit_bias if t < vocab]
            bias = torch.tensor([logit_bias[t] for t in ids], dtype=logits.dtype, device=logits.device)
            logits[row, ids] += bias
        constrained = set(batch.token_bitmask_rows)
        if constrained:
            bias = bitmask_bias(batch.token_bitmask.to(logits.device), vocab)  # [k, vocab]: 0 or -inf
            if len(constrained) == logits.shape[0] and list(batch.token_bitmask_rows) == list(range(len(constrained))):
                logits += bias
            else:
                logits.index_add_(0, torch.tensor(batch.token_bitmask_rows, device=logits.device), bias)
        for row, tokens in batch.banned_tokens.items():
            banned = [t for t in tokens if t < vocab]
            if row in constrained:
                left = torch.isfinite(logits[row])
                left[banned] = False
                if not left.any():
                    continue
            logits[row, banned] = _MASK
        return logits

    # ------------------------------------------------------------------ drawing

    def _draw(self, logits: torch.Tensor, draws: list[_Row], batch: SamplingBatch) -> list[int]:
        index = torch.tensor([d.row for d in draws], device=logits.device)
        x = logits.index_select(0, index)  # [num_draws, vocab]
        temperatures = batch.temperatures
        greedy = [temperatures[d.row] == 0.0 for d in draws]
        result = torch.empty(len(draws), dtype=torch.long, device=logits.device)
        if any(greedy):
            g = torch.tensor(greedy, device=logits.device)
            result[g] = x[g].argmax(dim=-1)
        if all(greedy):
            return result.tolist()
        sampled = [i for i, is_g in enumerate(greedy) if not is_g]
        s_index = torch.tensor(sampled, device=logits.device)
        rows = [draws[i].row for i in sampled]
        probs = self._truncated_probs(
            x[s_index],
            [temperatures[r] for r in rows],
            [batch.top_ks[r] for r in rows] if batch.has_top_k_or_p else None,
            [batch.top_ps[r] for r in rows] if batch.has_top_k_or_p else None,
            [batch.min_ps[r] for r in rows] if batch.has_min_p else None,
        )  # [num_sampled, vocab]
        q = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            d = draws[i]
            q[j].exponential_(generator=_seeded_generator(d.seed, d.sample_index, d.output_index, probs.device))
        result[s_index] = (probs / q).argmax(dim=-1)
        return result.tolist()

    def _truncated_probs(
        self,
        logits: torch.Tensor,
        temperatures: Sequence[float],
        top_ks: Sequence[int] | None,
        top_ps: Sequence[float] | None,
        min_ps: Sequence[float] | None,
    ) -> torch.Tensor:
        """Probabilities after temperature, top-k then top-p, then min-p; one row per entry
        of the parameter lists (None: off for every row; top_ks and top_ps go together)."""
        device = logits.device
        temperature = torch.tensor(temperatures, device=device).unsqueeze(1)
        logits = logits / temperature
        if top_ks is not None and (any(k != -1 for k in top_ks) or any(p < 1.0 for p in top_ps)):
            vocab = logits.shape[-1]
            k = torch.tensor([vocab if k == -1 else min(k, vocab) for k in top_ks], device=device)
            sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, vocab]
            ranks = torch.arange(vocab, device=device).unsqueeze(0)
            drop = ranks >= k.unsqueeze(1)
            # top-p is measured on what top-k leaves (as HF's warpers and vLLM do): keep the
            # smallest prefix whose mass reaches top_p (the first token always stays)
            sorted_probs = sorted_logits.masked_fill(drop, _MASK).softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= torch.tensor(top_ps, device=device).unsqueeze(1)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, _MASK)
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if min_ps is not None and any(m > 0 for m in min_ps):
            threshold = torch.tensor(min_ps, device=device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    # ------------------------------------------------------------------ results

    def _fill(self, samples, owners, draws, tokens, raw_logprobs, logprobs_k: Sequence[int | None]) -> None:
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
                k = logprobs_k[draw.row]
                if k is not None:
                    if sample.top_logprobs is None:
                        sample.top_logprobs = []
                    sample.top_logprobs.append(_top_logprobs(raw_logprobs[draw.row], tokens[d], chosen[d], k))
                d += 1

    def _beam_candidates(self, seq_id: int, logprobs: torch.Tensor, width: int) -> SeqSample:
        """The best beam_factor * width continuations of one beam, best first."""
        values, indices = logprobs.topk(min(self.beam_factor * width, logprobs.shape[-1]))
        return SeqSample(seq_id, indices.tolist(), values.tolist())


def _plain_greedy(logits: torch.Tensor, raw_logprobs: torch.Tensor, seq_ids: Sequence[int]) -> SamplerOutput:
    """Every row greedy with one draw, no logprobs, no controls: one argmax, one gather."""
    tokens = logits.argmax(dim=-1, keepdim=True)  # [num_rows, 1]
    chosen = raw_logprobs.gather(1, tokens)  # [num_rows, 1]
    # tolist() of [num_rows, 1] gives each SeqSample its one-token lists, built in C
    return SamplerOutput(list(map(SeqSample, seq_ids, tokens.tolist(), chosen.tolist())))


_BYTE_BIASES: dict[torch.device, torch.Tensor] = {}


def bitmask_bias(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[k, words] int32 packed bitmasks (little-endian) -> [k, vocab] float32: 0 where a
    token is allowed, -inf where not (tokens past the bitmask's 32 * words are not).

    Each byte of the masks looks up its 8 biases in a [256, 8] table (one embedding
    gather), and the caller adds them: branch-free, several times faster on CPU than
    unpacking bits and masked_fill (benchmarks/structured_outputs.py)."""
    table = _BYTE_BIASES.get(bitmask.device)
    if table is None:
        bits = (torch.arange(256, dtype=torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
        table = _BYTE_BIASES[bitmask.device] = torch.where(bits.bool(), 0.0, _MASK).to(bitmask.device)  # [256, 8]
    num_rows = bitmask.shape[0]
    byte_ids = bitmask.contiguous().view(torch.uint8).long()  # [k, 4 * words]
    bias = torch.nn.functional.embedding(byte_ids, table).view(num_rows, -1)  # [k, 32 * words]
    if bias.shape[1] >= vocab:
        return bias[:, :vocab]
    pad = torch.full((num_rows, vocab - bias.shape[1]), _MASK, device=bitmask.device)
    return torch.cat([bias, pad], dim=1)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, float]]:
    """Per row of `logits` [n, vocab]: the target token's log-softmax and the top k's (the
    float32 log-softmax of the model's logits, as HF computes it)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    if k <= 0:
        return [{t: lp} for t, lp in zip(targets, chosen)]
    values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [n, k]
    tops = []
    for t, lp, ids, vals in zip(targets, chosen, indices.tolist(), values.tolist()):
        top = dict(zip(ids, vals))
        top[t] = lp
        tops.append(top)
    return tops


def _top_logprobs(logprobs: torch.Tensor, token: int, token_logprob: float, k: int) -> dict[int, float]:
    """The sampled token's logprob and the k most likely tokens' (OpenAI's top_logprobs)."""
    top = {}
    if k > 0:
        values, indices = logprobs.topk(k)
        top = dict(zip(indices.tolist(), values.tolist()))
    top[token] = token_logprob
    return top
