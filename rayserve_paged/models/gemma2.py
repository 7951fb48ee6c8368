"""Gemma 2: sliding-window (4096) and global layers alternating, attention logits soft-capped
(50) and output logits (30), queries scaled by `query_pre_attn_scalar ** -0.5`, GeLU-tanh,
embeddings × sqrt(hidden_size), (1 + w) RMSNorms, and a norm after each sublayer as well as
before it ("sandwich"), with tied embeddings:

    x ── norm ── attn ── norm ── +x ── norm ── mlp ── norm ── +
"""

from __future__ import annotations

from rayserve_paged.ops.attention import AttentionMetadata

from .decoder import DecoderConfig, DecoderContext, DecoderForCausalLM, DecoderLayer, decoder_config_from_hf
from .layers import KVCache


def gemma_config_fields(c: dict) -> dict:
    """What every Gemma generation reads the same way."""
    return dict(
        hidden_act=c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh",
        norm_weight_offset=1.0,
        embed_scale=c["hidden_size"] ** 0.5,
        attn_scale=c.get("query_pre_attn_scalar", c.get("head_dim", 256)) ** -0.5,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
    )


class SandwichDecoderLayer(DecoderLayer):
    """Pre- and post-norms around each sublayer (Gemma 2 and 3); post_attention_layernorm
    normalises the attention output here, not the stream before the MLP."""

    def __init__(self, ctx: DecoderContext, layer_idx: int) -> None:
        super().__init__(ctx, layer_idx)
        self.pre_feedforward_layernorm = ctx.norm(ctx.config.hidden_size)
        self.post_feedforward_layernorm = ctx.norm(ctx.config.hidden_size)

    def forward(self, positions, x, residual, kv_cache: KVCache, attn_metadata: AttentionMetadata):
        """x is the previous sublayer's output, residual the stream before it (None at layer 0)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, attn_metadata))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


def gemma2_layer_types(num_layers: int) -> tuple[str, ...]:
    """transformers' default: even layers sliding, odd layers global."""
    return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers))


class Gemma2ForCausalLM(DecoderForCausalLM):
    layer_class = SandwichDecoderLayer

    @classmethod
    def config_from_hf(cls, c: dict) -> DecoderConfig:
        return decoder_config_from_hf(
            c,
            **gemma_config_fields(c),
            attn_soft_cap=c.get("attn_logit_softcapping"),
            final_soft_cap=c.get("final_logit_softcapping"),
            layer_types=gemma2_layer_types(c["num_hidden_layers"]),
        )
