"""Speculative decoding with a draft model (method draft_model): greedy output equals
decoding without drafts token for token under swap and recompute preemption, with the block
manager's invariants after every step; the target as its own draft accepts every draft (the
draft's KV pool follows every step, swap, copy and prefix-cache hit); sampling keeps the
distribution (chi-square, with a draft whose q differs from p); what the config refuses."""

from __future__ import annotations

import collections
import math
import random
import shutil

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.config import EngineConfig
from rayserve_paged.models.sampler import Sampler
from rayserve_paged.models.tiny import TINY_VOCAB_SIZE, make_tiny_model
from tests.engine.test_every_request_ends import _assert_idle
from tests.engine.test_speculative import WORLDS, _chi_square, _verify_batch, assert_seeded_requests_repeat, generate_as_without_drafts, mixed_params


@pytest.fixture(scope="module")
def drafts(tiny_paths, tmp_path_factory):
    """{"layer": a 1-layer random llama of the tiny vocabulary, "sharp": the target with its
    LM head scaled by 3 (q: p at a third of the temperature; the same top tokens, so drafts
    are accepted often and rejected often)}."""
    layer = make_tiny_model("llama", tmp_path_factory.mktemp("draft-layer"), seed=1, num_hidden_layers=1)
    sharp = tmp_path_factory.mktemp("draft-sharp")
    shutil.copytree(tiny_paths["llama"], sharp, dirs_exist_ok=True)
    weights = load_file(str(sharp / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 3.0
    save_file(weights, str(sharp / "model.safetensors"), metadata={"format": "pt"})
    return {"layer": str(layer), "sharp": str(sharp)}


def _spec(model: str, k: int = 3) -> dict:
    return dict(method="draft_model", model=model, num_speculative_tokens=k, disable_by_batch_size=64)


def _random_prompts(rng: random.Random, num: int) -> list[list[int]]:
    return [[rng.randrange(4, 500) for _ in range(rng.randrange(3, 30))] for _ in range(num)]


@pytest.mark.parametrize("world", ["swap", "recompute"])
@pytest.mark.parametrize("draft", ["layer", "self"])
def test_greedy_output_is_the_same_with_a_draft_model(tiny_paths, drafts, world, draft):
    """A random 1-layer draft (drafts mostly rejected) and the target as its own draft
    (every draft accepted, through preemption, chunked prefill and prefix-cache hits)."""
    rng = random.Random(f"draft-{world}")
    prompts = _random_prompts(rng, 7)
    prompts += [prompts[0][:17] + p for p in prompts[1:3]]  # prefix-cache hits
    params = mixed_params(rng, len(prompts), SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10))
    model = tiny_paths["llama"] if draft == "self" else drafts[draft]
    on, check = generate_as_without_drafts(tiny_paths["llama"], _spec(model), WORLDS[world], prompts, params)
    engine = on.engine
    counters = engine.scheduler.counters
    assert counters.spec_decode_num_draft_tokens > 0
    assert counters.preemptions_swap + counters.preemptions_recompute > 0
    if draft == "self":
        assert engine.spec_decode_num_accepted_tokens == counters.spec_decode_num_draft_tokens
    _assert_idle(on, check)


def test_verification_with_a_draft_distribution_keeps_p_and_a_wrong_residual_fails():
    """Drafts drawn from q (6 tokens), one each, 6000 times at fixed seeds: the first
    output token is distributed as p. Redrawing a rejected draft from p instead of the
    residual max(0, p - q) gives a distribution the counts are far from."""
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, 0.0, -1.0])
    p = logits.softmax(-1)
    q = torch.tensor([0.05, 0.4, 0.05, 0.1, 0.3, 0.1])
    num = 6000
    gen = torch.Generator().manual_seed(7)
    drafted = torch.multinomial(q, num, replacement=True, generator=gen).tolist()
    batch = _verify_batch(num, 1.0, seed=2000)
    samples = Sampler().verify(logits.repeat(2 * num, 1), batch, [[d] for d in drafted], [[q]] * num)
    counts = [0] * len(p)
    for sample in samples:
        counts[sample.token_ids[0]] += 1
    assert _chi_square(counts, p.tolist()) < 20.5, counts  # 5 degrees of freedom: P(chi2 > 20.5) = 0.001
    accept = torch.minimum(torch.ones(6), p / q)  # P(output = t) under the wrong rule
    wrong = q * accept + (q * (1 - accept)).sum() * p
    assert _chi_square(counts, wrong.tolist()) > 100, counts


def _chi_square_critical(df: int) -> float:
    """The 0.999 quantile of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_have_the_same_frequencies_with_a_draft_model(tiny_paths, drafts):
    """Temperature 1, top_k 3, seeds 0..N-1: the pairs of consecutive output tokens
    (positions 0-1, 1-2, 2-3) have the same frequencies with the sharp draft as without
    drafts (two-sample chi-square at the 0.001 level). Redrawing a rejected draft from p
    instead of max(0, p - q) fails it (the draft's favourite comes out too often: 37, 83
    and 95 against the bounds 26, 42 and 79 at these seeds)."""
    prompt = [17, 230, 41, 9, 388, 52, 120, 7]
    num = 300
    counts = {}
    for name, spec in (("off", None), ("on", _spec(drafts["sharp"]))):
        llm = LLM(model=tiny_paths["llama"], max_model_len=32, num_gpu_blocks_override=400, swap_space_gb=0,
                  max_num_seqs=64, speculative_config=spec)  # fmt: skip
        params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, seed=s, ignore_eos=True) for s in range(num)]
        outs = []
        for i in range(0, num, 60):  # 60 at a time: under disable_by_batch_size 64
            outs += llm.generate(prompt_token_ids=[prompt] * 60, sampling_params=params[i : i + 60], use_tqdm=False)
        counts[name] = [collections.Counter() for _ in range(3)]
        for out in outs:
            tokens = out.outputs[0].token_ids
            for pos in range(3):
                counts[name][pos][tokens[pos], tokens[pos + 1]] += 1
        if spec is not None:
            engine = llm.engine
            num_drafts = engine.scheduler.counters.spec_decode_num_draft_tokens
            assert 0 < engine.spec_decode_num_accepted_tokens < num_drafts  # accepted and rejected drafts
    for pos in range(3):
        a, b = counts["off"][pos], counts["on"][pos]
        pairs = set(a) | set(b)
        stat = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in pairs)
        assert stat < _chi_square_critical(len(pairs) - 1), (pos, a, b)


def test_seeded_requests_repeat_with_a_draft_model(tiny_paths, drafts):
    llm = assert_seeded_requests_repeat(tiny_paths["llama"], _spec(drafts["sharp"]))
    assert llm.engine.spec_decode_num_accepted_tokens > 0


# ---------------------------------------------------------------------------- configuration


def test_draft_model_config_errors_are_clear(tiny_paths, tmp_path):
    with pytest.raises(ValidationError, match="needs `model`"):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValidationError, match="tensor_parallel_size 1 only"):
        EngineConfig(tensor_parallel_size=2, speculative_config=_spec("tiny-llama"))
    with pytest.raises(ValidationError, match="method 'draft_model'"):
        EngineConfig(speculative_config={"method": "ngram", "model": "tiny-llama"})
    with pytest.raises(ValidationError, match="eagle"):
        EngineConfig(speculative_config={"method": "eagle", "model": "x"})
    wide = make_tiny_model("llama", tmp_path / "wide", vocab_size=TINY_VOCAB_SIZE + 64, num_hidden_layers=1)
    wide_vocab, vocab = TINY_VOCAB_SIZE + 64, TINY_VOCAB_SIZE
    message = rf"vocabulary \({wide_vocab} tokens\) differs from the target model's \({vocab} tokens\)"
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_paths["llama"], max_model_len=64, kv_cache_memory_gb=0.01, speculative_config=_spec(str(wide)))


def test_a_draft_that_is_mostly_rejected_is_paused_and_a_good_one_is_not(tiny_paths, drafts):
    """The random 1-layer draft seldom matches the target: after a window of verification
    steps below min_accepted_per_step its sequences stop drafting (16 decode steps, then 32),
    with the same greedy tokens; the target as its own draft keeps drafting every step."""
    from rayserve_paged.core.spec_decode import WINDOW

    k, max_tokens = 3, 80
    prompt = [7, 8, 9, 10, 11, 12]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (expected,) = LLM(model=tiny_paths["llama"], max_model_len=128).generate(
        prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False
    )
    counts = {}
    for name, model, floor in (("layer", drafts["layer"], 1.0), ("unpaused", drafts["layer"], 0.0),
                               ("self", tiny_paths["llama"], 1.0)):  # fmt: skip
        llm = LLM(model=tiny_paths["llama"], max_model_len=128,
                  speculative_config={**_spec(model, k), "min_accepted_per_step": floor})  # fmt: skip
        (got,) = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids, name
        counters = llm.engine.scheduler.counters
        counts[name] = (counters.spec_decode_num_draft_tokens, llm.engine.spec_decode_num_accepted_tokens)
    drafted, accepted = counts["layer"]
    assert accepted < WINDOW * 1.0, counts  # the first window was low: that is what paused it
    # at most: a window, a pause of 16, a window, a pause of 32, a window (80 tokens end it)
    assert WINDOW * k <= drafted <= 3 * WINDOW * k, counts
    assert counts["unpaused"][0] > 3 * WINDOW * k, counts  # min_accepted_per_step 0: drafts all along
    drafted, accepted = counts["self"]
    assert accepted == drafted > max_tokens // 2, counts  # every draft kept: never paused
