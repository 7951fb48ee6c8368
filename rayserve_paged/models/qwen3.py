"""Qwen3 (dense): Llama with a per-head RMSNorm of q and k before RoPE, biases only when
`attention_bias`, explicit `head_dim`; sliding layers as Qwen2's."""

from __future__ import annotations

from .decoder import DecoderConfig, DecoderForCausalLM, decoder_config_from_hf
from .qwen2 import qwen_layer_types


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, c: dict) -> DecoderConfig:
        return decoder_config_from_hf(c, qk_norm=True, layer_types=qwen_layer_types(c))
