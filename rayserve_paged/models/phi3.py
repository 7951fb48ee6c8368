"""Phi-3: Llama with q/k/v fused into one checkpoint tensor (`qkv_proj`, rows [q | k | v]) and
gate/up into another (`gate_up_proj`, rows [gate | up]), both split into the TP shards at
load; a sliding window on every layer when `sliding_window` is set (the 4k models: 2047).
LongRoPE (the 128k models) is not supported: it fails at load naming it.
"""

from __future__ import annotations

from .decoder import SLIDING, DecoderConfig, DecoderForCausalLM, decoder_config_from_hf

# one checkpoint tensor -> every shard of our fused module
FUSED_PROJECTIONS = {"qkv_proj": ("qkv_proj", ("q", "k", "v")), "gate_up_proj": ("gate_up_proj", (0, 1))}


class Phi3ForCausalLM(DecoderForCausalLM):
    packed_modules = FUSED_PROJECTIONS

    @classmethod
    def config_from_hf(cls, c: dict) -> DecoderConfig:
        layer_types = (SLIDING,) * c["num_hidden_layers"] if c.get("sliding_window") else ()
        return decoder_config_from_hf(c, layer_types=layer_types)
