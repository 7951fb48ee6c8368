"""Qwen2 / Qwen2.5: Llama with biases on q/k/v (none on o), tied embeddings in the small
sizes, and a sliding window on layers >= `max_window_layers` when `use_sliding_window`."""

from __future__ import annotations

from .decoder import FULL, SLIDING, DecoderConfig, DecoderForCausalLM, decoder_config_from_hf


def qwen_layer_types(c: dict) -> tuple[str, ...]:
    """transformers' rule when config.json has no `layer_types`."""
    num_layers = c["num_hidden_layers"]
    if not (c.get("use_sliding_window") and c.get("sliding_window")):
        return ()
    first = c.get("max_window_layers", num_layers)
    return tuple(SLIDING if i >= first else FULL for i in range(num_layers))


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, c: dict) -> DecoderConfig:
        return decoder_config_from_hf(c, qkv_bias=True, o_bias=False, layer_types=qwen_layer_types(c))
