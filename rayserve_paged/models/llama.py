"""Llama 1-3.x (RoPE with linear / llama3 scaling, RMSNorm, SwiGLU, grouped-query attention):
the decoder skeleton as it is (decoder.py), config read as every Llama-shaped config.json
spells it; q/k/v and o biases both follow `attention_bias`.
"""

from __future__ import annotations

from .decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
