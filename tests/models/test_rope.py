"""RoPE settings from transformers-5 `rope_parameters` and from older `rope_theta` /
`rope_scaling` keys give the same model, and match transformers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rayserve_paged.models.decoder import DecoderContext
from rayserve_paged.models.layers import RopeScaling, RotaryEmbedding, rope_inv_freq, rope_scaling_from_hf

from .conftest import hf_logits, make_runner

PROMPTS = [[1, *range(100, 130)], [1, 7, 8, 9]]
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# (new-style overrides, old-style overrides) describing the same RoPE
EQUIVALENT = {
    "default": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        {"rope_parameters": None, "rope_theta": 500000.0},
    ),
    "linear": (
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        {"rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
    ),
    "llama3": (
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}},
        {"rope_parameters": None, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}},
    ),
}


def _prefill(path) -> torch.Tensor:
    return make_runner(path).step(list(enumerate(PROMPTS)), all_logits=True)


@pytest.mark.parametrize("kind", list(EQUIVALENT))
def test_new_and_old_keys_load_the_same_and_match_hf(kind, tiny_checkpoint, hf_model):
    new_style, old_style = EQUIVALENT[kind]
    new_path, old_path = tiny_checkpoint("llama", **new_style), tiny_checkpoint("llama", **old_style)
    ours_new, ours_old = _prefill(new_path), _prefill(old_path)
    assert torch.equal(ours_new, ours_old)
    for path in (new_path, old_path):
        ref = torch.cat([hf_logits(hf_model(path), p) for p in PROMPTS])
        torch.testing.assert_close(ours_new, ref, atol=1e-4, rtol=0)


def test_theta_matters(tiny_checkpoint):
    base = _prefill(tiny_checkpoint("llama"))  # theta 10000
    other = _prefill(tiny_checkpoint("llama", **EQUIVALENT["default"][0]))  # theta 500000
    assert not torch.allclose(base, other, atol=1e-3)


def test_parse_defaults_and_fallbacks():
    assert rope_scaling_from_hf({}) == RopeScaling()
    assert rope_scaling_from_hf({"rope_theta": 1e6, "rope_scaling": None}).theta == 1e6
    # a rope_parameters dict without a theta takes the top-level one
    parsed = rope_scaling_from_hf({"rope_theta": 5e5, "rope_parameters": {"rope_type": "linear", "factor": 2}})
    assert (parsed.rope_type, parsed.theta, parsed.factor) == ("linear", 5e5, 2.0)
    llama3 = rope_scaling_from_hf({"max_position_embeddings": 4096, "rope_scaling": {"type": "llama3", "factor": 8}})
    assert llama3.original_max_position_embeddings == 4096


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_inv_freq_matches_transformers(kind):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = EQUIVALENT[kind][0]["rope_parameters"]
    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=dict(params))
    expected, _ = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    ours = rope_inv_freq(128, rope_scaling_from_hf({"rope_parameters": params}))
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 4.0, "original_max_position_embeddings": 64},
        {"factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.5},
        {"factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.25},
    ],
)
def test_yarn_inv_freq_and_attention_factor_match_transformers(params):
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from rayserve_paged.models.layers import rope_attention_scaling

    rope_parameters = {"rope_type": "yarn", "rope_theta": 1e6, **params}
    hf_config = Qwen2Config(hidden_size=256, num_attention_heads=2, max_position_embeddings=256,
                            rope_parameters=dict(rope_parameters))  # fmt: skip
    expected, expected_scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    rope = rope_scaling_from_hf({"rope_parameters": rope_parameters, "max_position_embeddings": 256})
    torch.testing.assert_close(rope_inv_freq(128, rope), expected, atol=0, rtol=1e-6)
    assert rope_attention_scaling(rope) == pytest.approx(expected_scaling, rel=1e-12)


def test_layers_share_one_rotary_and_a_forward_computes_cos_sin_once(tiny_checkpoint, monkeypatch):
    runner = make_runner(tiny_checkpoint("llama"))
    layers = runner.model.model.layers
    rotary = layers[0].self_attn.rotary_emb
    assert len(layers) > 1 and all(layer.self_attn.rotary_emb is rotary for layer in layers)
    computed = []
    compute = RotaryEmbedding.cos_sin
    monkeypatch.setattr(RotaryEmbedding, "cos_sin", lambda self, *a: computed.append(1) or compute(self, *a))
    memoized = runner.step(list(enumerate(PROMPTS)), all_logits=True)
    assert len(computed) == 1  # one prefill step, every layer
    assert rotary._step_cos_sin is None and not rotary._in_step  # nothing held past the forward
    # the same step with cos/sin recomputed at every layer: bit for bit the same logits
    monkeypatch.setattr(RotaryEmbedding, "begin_step", lambda self: None)
    computed.clear()
    fresh = make_runner(tiny_checkpoint("llama"))
    assert torch.equal(fresh.step(list(enumerate(PROMPTS)), all_logits=True), memoized)
    assert len(computed) == len(layers)


def test_one_rotary_per_distinct_rope_and_none_reused_outside_a_step():
    ctx = DecoderContext(None, None, None, torch.float32, nn.Module, nn.Module)
    default, linear = RopeScaling(), RopeScaling(rope_type="linear", factor=2.0)
    assert ctx.rotary_embedding(8, default) is ctx.rotary_embedding(8, RopeScaling())
    assert ctx.rotary_embedding(8, linear) is not ctx.rotary_embedding(8, default)
    assert ctx.rotary_embedding(4, default) is not ctx.rotary_embedding(8, default)
    assert len(ctx.rotary) == 3
    rotary = ctx.rotary_embedding(8, default)
    positions, q, k = torch.tensor([0, 1]), torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    first = rotary(positions, q, k)
    positions.fill_(5)  # written in place: outside begin_step / end_step nothing is memoized
    assert not torch.equal(rotary(positions, q, k)[0], first[0])
    rotary.begin_step()
    within = rotary(positions, q, k)
    memo = rotary._step_cos_sin
    assert memo is not None and memo[0] is positions
    assert torch.equal(rotary(positions, q, k)[0], within[0]) and rotary._step_cos_sin is memo  # reused
    other = torch.tensor([0, 1])  # another positions tensor: computed for it
    assert torch.equal(rotary(other, q, k)[0], first[0]) and rotary._step_cos_sin[0] is other
    rotary.end_step()
    assert rotary._step_cos_sin is None
