"""The sampler reads tensors and per-row parameter columns (SamplingBatch), never core's
request types; its fast all-greedy path gives exactly what the general path gives."""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest
import torch

import rayserve_paged
from rayserve_paged.models.sampler import RowPenalty, Sampler, SamplingBatch


def _batch(n: int, **columns) -> SamplingBatch:
    values = dict(
        seq_ids=list(range(100, 100 + n)), temperatures=[0.0] * n, top_ks=[-1] * n, top_ps=[1.0] * n,
        min_ps=[0.0] * n, seeds=[None] * n, sample_indices=[0] * n, output_indices=[0] * n, num_draws=[1] * n,
        beam_widths=[0] * n, logprobs=[None] * n,
    )
    return SamplingBatch(**(values | columns))


def _key(out):
    return [(s.seq_id, s.token_ids, s.logprobs, s.top_logprobs) for s in out.samples]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_plain_greedy_path_equals_the_general_path_token_and_logprob(dtype):
    logits = torch.randn(37, 64, generator=torch.Generator().manual_seed(0)).to(dtype)  # [rows, vocab]
    logits[3, [5, 9]] = logits[3].max() + 1  # a tie: both paths take the first index
    batch = _batch(37)
    assert batch.is_plain_greedy
    fast = Sampler()(logits, batch)
    general = _batch(37)
    general.is_plain_greedy = False  # force the per-draw path on the same rows
    slow = Sampler()(logits, general)
    assert _key(fast) == _key(slow)
    assert [s.token_ids[0] for s in fast.samples] == logits.float().argmax(dim=-1).tolist()
    assert fast.samples[3].token_ids == [5]
    expected = torch.log_softmax(logits.float(), dim=-1).max(dim=-1).values.tolist()
    assert [s.logprobs[0] for s in fast.samples] == expected


def test_flags_pick_the_fast_path_only_when_nothing_else_is_asked():
    assert _batch(4).is_plain_greedy
    assert _batch(4, top_ks=[5, -1, -1, -1]).is_plain_greedy  # top-k means nothing to argmax
    assert not _batch(4, logprobs=[None, 2, None, None]).is_plain_greedy
    assert not _batch(4, beam_widths=[0, 0, 2, 0]).is_plain_greedy
    assert not _batch(4, num_draws=[3, 1, 1, 1]).is_plain_greedy
    assert not _batch(4, logit_bias={1: {7: 1.0}}).is_plain_greedy
    assert not _batch(4, banned_tokens={0: [2]}).is_plain_greedy
    sampled = _batch(4, temperatures=[0.0, 0.7, 0.0, 0.0], top_ps=[1.0, 0.9, 1.0, 1.0], seeds=[None, 3, None, None])
    assert not sampled.is_all_greedy and sampled.has_top_k_or_p and sampled.has_seeds and not sampled.has_min_p
    assert _batch(0).is_plain_greedy and len(Sampler()(torch.zeros(0, 8), _batch(0)).samples) == 0


def test_a_column_or_logits_of_the_wrong_length_is_named():
    with pytest.raises(ValueError, match="top_ps has 2 rows, seq_ids has 3"):
        _batch(3, top_ps=[1.0, 1.0])
    with pytest.raises(ValueError, match="3 logits rows for a SamplingBatch of 2"):
        Sampler()(torch.zeros(3, 8), _batch(2))


def test_greedy_rows_in_a_mixed_batch_take_the_argmax_of_their_controlled_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    batch = _batch(
        3,
        logit_bias={0: {0: 5.0}},
        banned_tokens={1: [1, 9]},  # 9 is past the vocabulary: ignored
        penalties={2: RowPenalty([2, 1, 1], num_prompt_tokens=1, repetition=1.0, frequency=2.0, presence=0.0)},
    )
    out = Sampler()(logits, batch)
    assert [s.token_ids for s in out.samples] == [[0], [2], [2]]  # row 2: token 1 drops to 3 - 2*2; the prompt's token 2 is not counted
    raw = torch.log_softmax(logits, dim=-1)  # logprobs are the model's own, before the controls
    assert [s.logprobs[0] for s in out.samples] == [raw[0, 0].item(), raw[1, 2].item(), raw[2, 2].item()]


def test_draws_are_seeded_by_their_sample_index_whatever_shares_the_batch():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    both = _batch(2, temperatures=[1.0, 1.0], seeds=[7, 7], sample_indices=[0, 3], num_draws=[3, 1],
                  output_indices=[0, 4])
    out = Sampler()(logits, both)
    for row, first, copies in ((0, 0, 3), (1, 3, 1)):
        for j in range(copies):
            alone = _batch(1, temperatures=[1.0], seeds=[7], sample_indices=[first + j],
                           output_indices=[both.output_indices[row]])
            assert Sampler()(logits[row : row + 1], alone).samples[0].token_ids == [out.samples[row].token_ids[j]]


def test_models_import_nothing_from_core():
    """models/ knows tensors, not sequences (also the import-linter contract in pyproject.toml)."""
    graph = grimp.build_graph("rayserve_paged", cache_dir=None)
    assert not graph.chain_exists(importer="rayserve_paged.models", imported="rayserve_paged.core", as_packages=True)
    contracts = (Path(rayserve_paged.__file__).parents[1] / "pyproject.toml").read_text()
    assert 'source_modules = ["rayserve_paged.models"]\nforbidden_modules = ["rayserve_paged.core"]' in contracts
