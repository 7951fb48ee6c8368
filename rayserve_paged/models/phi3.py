"""Phi-3: Llama with q/k/v fused into one checkpoint tensor (`qkv_proj`, rows [q | k | v]) and
gate/up into another (`gate_up_proj`, rows [gate | up]), both split into the TP shards at
load; a sliding window on every layer when `sliding_window` is set (the 4k models: 2047);
LongRoPE for the 128k models (`rope_scaling.type` `longrope`, or the older `su`, which
transformers' Phi3Config reads as longrope, as it does `yarn`), with the sequence re-encoded
whole when it first passes `original_max_position_embeddings`, as Phi-3's `generate` does.
"""

from __future__ import annotations

import dataclasses

from .decoder import SLIDING, DecoderConfig, DecoderForCausalLM, decoder_config_from_hf

# one checkpoint tensor -> every shard of our fused module
FUSED_PROJECTIONS = {"qkv_proj": ("qkv_proj", ("q", "k", "v")), "gate_up_proj": ("gate_up_proj", (0, 1))}
LONGROPE_ALIASES = ("su", "yarn")  # Phi3Config turns these rope types into longrope


def _with_longrope_type(c: dict) -> dict:
    key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    params = c.get(key) or {}
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type not in LONGROPE_ALIASES:
        return c
    return {**c, key: {**params, "rope_type": "longrope"}}


class Phi3ForCausalLM(DecoderForCausalLM):
    packed_modules = FUSED_PROJECTIONS

    @classmethod
    def config_from_hf(cls, c: dict) -> DecoderConfig:
        layer_types = (SLIDING,) * c["num_hidden_layers"] if c.get("sliding_window") else ()
        cfg = decoder_config_from_hf(_with_longrope_type(c), layer_types=layer_types)
        if cfg.rope.rope_type != "longrope":
            return cfg
        # transformers' Phi-3 `generate` drops its cache when the sequence first passes the
        # original length and re-encodes it whole with the long factors
        return dataclasses.replace(cfg, rope_recompute_len=cfg.rope.original_max_position_embeddings + 1)
