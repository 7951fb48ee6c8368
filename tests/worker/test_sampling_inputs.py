"""Per-row facts -> SamplingBatch: a request's parameters become a row template once; each
step only places its rows (seeds, draws, controls exactly where the sampler expects them)."""

from __future__ import annotations

import torch

from rayserve_paged.core.outputs import NewRequest, StepMessage
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.models.sampler import Sampler
from rayserve_paged.worker.input_batch import InputBatch
from rayserve_paged.worker.sampling_inputs import row_template, sampling_batch

EOS = (2,)


def _step(batch: InputBatch, msg: StepMessage):
    """Apply the message to the worker's batch and build the sampler's batch for its rows."""
    batch.apply(msg)
    return batch.sampling_batch(msg, batch.rows(msg))


def _decodes(seq_ids, start):
    """A decode step of `seq_ids`, each at position `start`."""
    n = len(seq_ids)
    return StepMessage(seq_ids=list(seq_ids), start_positions=[start] * n, num_query_tokens=[1] * n, token_ids=[1] * n)


def test_a_groups_first_step_draws_best_of_from_sample_index_zero_then_one_per_sequence():
    params = SamplingParams(n=2, best_of=3, temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=11, logprobs=2)
    batch = InputBatch(EOS)
    prompt = StepMessage(
        new_requests=[NewRequest("a", 0, params, 4)], block_table_updates=[(0, 0, [0])], seq_ids=[0],
        start_positions=[0], num_query_tokens=[4], token_ids=[1, 2, 3, 4], first_step_seq_ids=[0],
    )
    first = _step(batch, prompt)
    assert (first.num_draws, first.sample_indices, first.output_indices) == ((3,), (0,), (0,))
    fork = _decodes([0, 5], 5)  # sequence 5 forked from 0 as the group's third sequence (index 2)
    fork.forks = [(0, 5, 2)]
    later = _step(batch, fork)
    assert later.seq_ids == (0, 5)
    assert (later.num_draws, later.sample_indices, later.output_indices) == ((1, 1), (0, 2), (2, 2))
    assert (later.temperatures, later.top_ks, later.top_ps, later.min_ps) == ((0.8,) * 2, (5,) * 2, (0.9,) * 2, (0.05,) * 2)
    assert (later.seeds, later.logprobs, later.beam_widths) == ((11, 11), (2, 2), (0, 0))
    assert not later.has_controls and later.has_seeds and later.has_logprobs


def test_greedy_is_temperature_zero_and_beam_rows_carry_only_their_width():
    greedy = row_template(SamplingParams(temperature=0.0), EOS)
    assert greedy.columns[0] == 0.0
    beam = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, logit_bias={4: 1.0}, min_tokens=5)
    msg = StepMessage(
        new_requests=[NewRequest("b", 7, beam, 4)], block_table_updates=[(7, 0, [0])], seq_ids=[7],
        start_positions=[0], num_query_tokens=[4], token_ids=[1, 2, 3, 4], first_step_seq_ids=[7],
    )
    batch = _step(InputBatch(EOS), msg)
    assert (batch.beam_widths, batch.num_draws) == ((3,), (1,))
    assert not batch.has_controls  # beam search samples nothing: no bias, no min_tokens mask (as before)
    out = Sampler(len(EOS), EOS)(torch.arange(10.0).unsqueeze(0), batch)
    assert out.samples[0].token_ids == [9, 8, 7, 6, 5, 4]  # beam_factor 2 * width 3, best first


def test_sparse_controls_land_on_the_rows_that_ask_and_only_while_they_apply():
    penalised = SamplingParams(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.2)
    biased = SamplingParams(temperature=0.0, logit_bias={3: -2.0})
    short = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6, 8])
    plain = SamplingParams(temperature=0.0)
    templates = [row_template(p, EOS) for p in (penalised, biased, short, plain)]
    history = [5, 5, 9]
    rows = [
        (templates[0], 0, 0, 1, 1, history, 2),
        (templates[3], 1, 0, 0, 1, None, 3),
        (templates[1], 2, 0, 0, 1, None, 3),
        (templates[2], 3, 0, 1, 1, None, 3),  # 1 output token < min_tokens 2
        (templates[2], 4, 0, 2, 1, None, 3),  # 2 output tokens: EOS allowed again
        (templates[0], 5, 0, 0, 1, None, 3),  # no history sent: nothing to penalise
    ]
    batch = sampling_batch(rows)
    assert list(batch.penalties) == [0]
    p = batch.penalties[0]
    assert (p.history, p.num_prompt_tokens, p.repetition, p.frequency, p.presence) == (history, 2, 1.2, 0.0, 0.5)
    assert batch.logit_bias == {2: {3: -2.0}}
    assert batch.banned_tokens == {3: (2, 6, 8)}
    assert batch.is_all_greedy and not batch.is_plain_greedy


def test_the_empty_step_is_an_empty_batch():
    batch = sampling_batch([])
    assert len(batch) == 0 and batch.is_plain_greedy
    assert Sampler()(torch.zeros(0, 5), batch).samples == []


def test_a_plain_greedy_decode_step_takes_the_fast_path():
    params = SamplingParams(temperature=0.0, max_tokens=None)
    state = InputBatch(EOS)
    state.apply(StepMessage(new_requests=[NewRequest(f"r{i}", i, params, 4) for i in range(8)],
                            block_table_updates=[(i, 0, [i]) for i in range(8)]))
    batch = _step(state, _decodes(range(8), 6))
    assert batch.is_plain_greedy
    logits = torch.randn(8, 20, generator=torch.Generator().manual_seed(3))
    out = Sampler(len(EOS), EOS)(logits, batch)
    assert [s.token_ids[0] for s in out.samples] == logits.argmax(dim=-1).tolist()
    assert [s.seq_id for s in out.samples] == list(range(8))
