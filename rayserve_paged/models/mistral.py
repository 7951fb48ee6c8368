"""Mistral: Llama with an optional sliding window (`sliding_window`, null in v0.2+), applied
to every layer when set."""

from __future__ import annotations

from .decoder import SLIDING, DecoderConfig, DecoderForCausalLM, decoder_config_from_hf


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, c: dict) -> DecoderConfig:
        window = c.get("sliding_window")
        layer_types = (SLIDING,) * c["num_hidden_layers"] if window else ()
        return decoder_config_from_hf(c, layer_types=layer_types)
