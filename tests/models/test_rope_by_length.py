"""RoPE whose frequencies depend on a length: LongRoPE (Phi-3 128k) and dynamic NTK (Llama),
against transformers, float32.

In transformers' `generate` a token's frequencies are those of the forward that computed it:
the prompt's length for prompt tokens (one prefill), p + 1 for the token generated at
position p. The engine gives each token rope_len(p) = max(num_prompt_tokens, p + 1) however
it chunks the prefill or recomputes after preemption. The thresholds here are tiny (LongRoPE's
original_max_position_embeddings 32, dynamic NTK's max_position_embeddings 32), so prompts
run below and above them and generations cross them.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rayserve_paged import SamplingParams
from rayserve_paged.models.layers import (
    RotaryEmbedding,
    dynamic_inv_freq_table,
    rope_attention_scaling,
    rope_inv_freq,
    rope_scaling_from_hf,
)
from rayserve_paged.models.loader import get_model_config
from rayserve_paged.models.layers import ROPE_LEN_PER_SEQUENCE, ROPE_LEN_PER_TOKEN
from rayserve_paged.worker.input_batch import RequestState, SeqState
from rayserve_paged.worker.static_decode import rope_lens_of

from .conftest import preempting_llm
from .families import write_family_checkpoint

THRESHOLD = 32
HEAD_HALF = 8  # head_dim 16 in tests/models/families.py
LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.25 * i for i in range(HEAD_HALF)],
    "long_factor": [1.5 + 3.0 * i for i in range(HEAD_HALF)],
}  # fmt: skip
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
CHECKPOINTS = {
    # no sliding window: every key's rotation shows in the logits; max 128 = 4 x the original 32
    "phi3-longrope": ("phi3", dict(sliding_window=None, max_position_embeddings=128,
                                   original_max_position_embeddings=THRESHOLD, rope_parameters=LONGROPE)),
    "llama-dynamic": ("llama", dict(max_position_embeddings=THRESHOLD, rope_parameters=DYNAMIC)),
    # LongRoPE outside Phi-3: no re-encoding when the threshold is passed (per-token lengths)
    "llama-longrope": ("llama", dict(max_position_embeddings=128, rope_parameters={
        **LONGROPE, "original_max_position_embeddings": THRESHOLD})),
}  # fmt: skip
# below the threshold and crossing it while generating (10, 28), above it from the start (40)
PROMPTS = [[1, *range(40, 49)], [1, *range(200, 227)], [1, *range(300, 339)]]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            family, overrides = CHECKPOINTS[name]
            made[name] = str(write_family_checkpoint(family, tmp_path_factory.mktemp(name), **overrides))
        return made[name]

    return make


def _hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    # a fresh copy per call: transformers' dynamic RoPE keeps the frequencies of the longest
    # sequence it has seen and reuses them for a later call whose length lies between
    # max_position_embeddings and that one
    with torch.no_grad():
        out = copy.deepcopy(hf).generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_rope_lens_per_token_and_per_sequence():
    seq = SeqState(0, RequestState("r", None, None, 5), [], 0, None)
    # per token: the prompt's length for prompt tokens, position + 1 past them
    assert rope_lens_of(seq, 0, 3, ROPE_LEN_PER_TOKEN) + rope_lens_of(seq, 3, 2, ROPE_LEN_PER_TOKEN) == [5] * 5
    assert [rope_lens_of(seq, p, 1, ROPE_LEN_PER_TOKEN)[0] for p in range(5, 8)] == [6, 7, 8]
    # per sequence: the prompt's while prefilling it, then one past the furthest computed token
    assert rope_lens_of(seq, 0, 3, ROPE_LEN_PER_SEQUENCE) == [5, 5, 5]
    seq.num_computed_max = 9  # a decode at position 9, or a recompute of the 10 tokens
    assert rope_lens_of(seq, 9, 1, ROPE_LEN_PER_SEQUENCE) == [10]
    assert rope_lens_of(seq, 0, 4, ROPE_LEN_PER_SEQUENCE) == [10] * 4


def test_longrope_frequencies_and_attention_factor_equal_transformers():
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                           original_max_position_embeddings=THRESHOLD, rope_parameters=dict(LONGROPE))  # fmt: skip
    rope = rope_scaling_from_hf(hf_config.to_dict())
    assert (rope.rope_type, rope.original_max_position_embeddings, rope.factor) == ("longrope", THRESHOLD, 4.0)
    short, scaling = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=THRESHOLD + 1)
    assert torch.equal(rope_inv_freq(16, rope), short)
    assert rope_attention_scaling(rope) == scaling > 1
    rotary = RotaryEmbedding(16, rope)
    lens = torch.tensor([1, THRESHOLD, THRESHOLD + 1, 100])
    picked = rotary._token_inv_freq(lens)  # [4, D/2]
    assert torch.equal(picked, torch.stack([short, short, long, long]))
    # a config-level attention_factor wins; top-level original_max_position_embeddings wins
    explicit = rope_scaling_from_hf({"original_max_position_embeddings": 16, "max_position_embeddings": 64,
                                     "rope_scaling": {**LONGROPE, "attention_factor": 1.5,
                                                      "original_max_position_embeddings": 8}})  # fmt: skip
    assert (explicit.original_max_position_embeddings, rope_attention_scaling(explicit)) == (16, 1.5)


@pytest.mark.parametrize("factor", [2.0, 4.0, 3.7])
def test_dynamic_frequencies_equal_transformers_at_every_length(factor):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**DYNAMIC, "factor": factor}
    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=THRESHOLD,
                            rope_parameters=dict(params))  # fmt: skip
    rope = rope_scaling_from_hf(hf_config.to_dict())
    table = dynamic_inv_freq_table(16, rope, 4 * THRESHOLD)  # [129, D/2]
    unscaled, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu")
    assert all(torch.equal(table[n], unscaled) for n in range(THRESHOLD + 1))
    for n in range(THRESHOLD + 1, 4 * THRESHOLD + 1):  # seq_len as transformers passes it: max(position_ids) + 1
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=torch.tensor([[n - 1]]).max() + 1)
        assert torch.equal(table[n], expected), n
    assert not torch.equal(table[THRESHOLD + 1], unscaled)


def test_loaded_config_serves_dynamic_to_max_positions_times_factor(checkpoint):
    dynamic = get_model_config(checkpoint("llama-dynamic"))
    assert (dynamic.max_model_len, dynamic.is_rope_length_dependent) == (4 * THRESHOLD, True)
    longrope = get_model_config(checkpoint("phi3-longrope"))
    assert (longrope.max_model_len, longrope.is_rope_length_dependent) == (128, True)
    assert longrope.rope_recompute_len == THRESHOLD + 1 and dynamic.rope_recompute_len is None
    assert get_model_config(checkpoint("llama-longrope")).rope_recompute_len is None


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_engine_greedy_equals_hf_with_chunked_prefill_and_preemption(name, mode, checkpoint, hf_model):
    path = checkpoint(name)
    # 12 blocks of 8 for 3 requests growing to 30-59 tokens: preempts; 8-token chunks beside decodes
    llm = preempting_llm(path, mode, num_blocks=12, max_model_len=64, chunk=8, max_num_seqs=3)
    assert not llm.engine.block_manager.enable_prefix_caching  # K depends on each request's prompt length
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    counters = llm.engine.scheduler.counters
    assert (counters.preemptions_swap if mode == "swap" else counters.preemptions_recompute) > 0
    static = llm.engine.executor.worker.runner.static_decode
    assert static.runs["eager"] > 0  # decode-only steps ran on the padded buckets
    hf = hf_model(path)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == _hf_greedy(hf, prompt, MAX_TOKENS)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_rope_by_length_changes_the_tokens(name, checkpoint, hf_model):
    """The scaled frequencies matter here: HF with the unscaled ones only, as if the threshold
    were never crossed, generates other tokens for the long prompt."""
    import json
    import shutil
    from pathlib import Path

    path = Path(checkpoint(name))
    plain = path.parent / f"{path.name}-plain"
    if not plain.exists():
        shutil.copytree(path, plain)
        config = json.loads((plain / "config.json").read_text())
        config["max_position_embeddings"] = 1024
        if name == "llama-dynamic":
            config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        else:  # short factors only, the same attention factor
            config["original_max_position_embeddings"] = 1024
            config["rope_parameters"] |= {"original_max_position_embeddings": 1024, "factor": 4.0}
        (plain / "config.json").write_text(json.dumps(config))
    assert _hf_greedy(hf_model(str(path)), PROMPTS[2], MAX_TOKENS) != _hf_greedy(
        hf_model(str(plain)), PROMPTS[2], MAX_TOKENS
    )
