"""Llama-family decoders (RoPE, RMSNorm, SwiGLU, grouped-query attention) for paged serving.

One decoder layer, pre-norm, with the residual add fused into the next RMSNorm:

    x ── RMSNorm ── qkv (column) ── RoPE(q, k) ── paged attention ── o (row, all-reduce) ── +x
      ── RMSNorm ── gate|up (column) ── silu(gate) * up ── down (row, all-reduce) ── +

Parameter names follow HF's `model.layers.*`, with q/k/v fused into `qkv_proj` and gate/up
fused into `gate_up_proj`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rayserve_paged.ops.attention import AttentionMetadata

from .layers import (
    SINGLE_RANK,
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    ParallelState,
    QKVParallelLinear,
    RMSNorm,
    RopeScaling,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    rope_scaling_from_hf,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache), each [blocks, block_size, Hkv, D]


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeScaling
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, c: dict) -> LlamaConfig:
        num_heads = c["num_attention_heads"]
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported Llama hidden_act {c['hidden_act']!r}; only 'silu' is supported")
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
            intermediate_size=c["intermediate_size"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope=rope_scaling_from_hf(c),
            attention_bias=c.get("attention_bias", False),
            mlp_bias=c.get("mlp_bias", False),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
        )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: Any, parallel: ParallelState, dtype: torch.dtype | None) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, bias=cfg.attention_bias, parallel=parallel, dtype=dtype
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * d, cfg.hidden_size, bias=cfg.attention_bias, parallel=parallel, dtype=dtype
        )
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.head_dim = d
        self.rotary_emb = RotaryEmbedding(d, cfg.rope)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5, backend=backend)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H/tp, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv/tp, D]
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [T, H/tp * D]
        return self.o_proj(out)  # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, parallel: ParallelState, dtype: torch.dtype | None) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], bias=cfg.mlp_bias, parallel=parallel, dtype=dtype
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=cfg.mlp_bias, parallel=parallel, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I/tp] each
        return self.down_proj(F.silu(gate) * up)  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: Any, parallel: ParallelState, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, backend, parallel, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = LlamaMLP(cfg, parallel, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous sublayer's output, residual the stream before it (None at layer 0)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, attn_metadata)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: Any, parallel: ParallelState, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel=parallel, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, parallel, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, attn_metadata)
        x, _ = self.norm(x, residual)
        return x  # [T, hidden]


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, hidden]."""

    def __init__(
        self,
        hf_config: dict,
        attn_backend: Any,
        parallel: ParallelState = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = LlamaConfig.from_hf(hf_config)
        cfg = self.config
        self.model = LlamaModel(cfg, attn_backend, parallel, dtype)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel=parallel, dtype=dtype, tied_to=tied)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)  # [n, vocab] float32

    def map_weight_name(self, hf_name: str) -> tuple[str, Any] | None:
        """HF checkpoint name -> (our parameter name, shard id), or None to skip it."""
        if "rotary_emb.inv_freq" in hf_name:  # a buffer some old checkpoints saved
            return None
        if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        for proj, shard in (("q", "q"), ("k", "k"), ("v", "v")):
            marker = f".self_attn.{proj}_proj."
            if marker in hf_name:
                return hf_name.replace(marker, ".self_attn.qkv_proj."), shard
        for proj, shard in (("gate", 0), ("up", 1)):
            marker = f".mlp.{proj}_proj."
            if marker in hf_name:
                return hf_name.replace(marker, ".mlp.gate_up_proj."), shard
        return hf_name, None
