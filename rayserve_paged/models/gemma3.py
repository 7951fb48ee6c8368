"""Gemma 3 (text): Gemma 2's sandwich layers and (1 + w) norms, plus a per-head q/k RMSNorm,
sliding layers in a 5:1 pattern (`layer_types`, else `sliding_window_pattern`), two RoPE
settings (sliding layers: base 10000; global layers: base 1e6, linearly scaled in the larger
sizes), and no soft-caps unless the config sets them.
"""

from __future__ import annotations

from .decoder import FULL, SLIDING, DecoderConfig, DecoderForCausalLM, decoder_config_from_hf
from .gemma2 import SandwichDecoderLayer, gemma_config_fields
from .layers import RopeScaling, rope_scaling_from_hf


def gemma3_ropes(c: dict) -> tuple[RopeScaling, RopeScaling]:
    """(global, sliding) RoPE: transformers 5 writes one `rope_parameters` dict per layer
    type; older configs `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq`."""
    params = c.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full = rope_scaling_from_hf({**c, "rope_parameters": params.get(FULL) or {"rope_theta": 1e6}})
        local = rope_scaling_from_hf({**c, "rope_parameters": params.get(SLIDING) or {"rope_theta": 1e4}})
        return full, local
    full = rope_scaling_from_hf({"rope_theta": 1e6, **c})
    local = {"rope_type": "default", "rope_theta": float(c.get("rope_local_base_freq", 1e4))}
    return full, rope_scaling_from_hf({**c, "rope_parameters": local})


class Gemma3ForCausalLM(DecoderForCausalLM):
    layer_class = SandwichDecoderLayer

    @classmethod
    def config_from_hf(cls, c: dict) -> DecoderConfig:
        full, local = gemma3_ropes(c)
        pattern = c.get("sliding_window_pattern", 6)
        layer_types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(c["num_hidden_layers"]))
        return decoder_config_from_hf(
            {**c, "rope_parameters": None},
            **gemma_config_fields(c),
            qk_norm=True,
            rope=full,
            local_rope=local,
            attn_soft_cap=c.get("attn_logit_softcapping"),
            final_soft_cap=c.get("final_logit_softcapping"),
            layer_types=layer_types,
        )
