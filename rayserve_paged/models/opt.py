"""OPT (Zhang et al. 2022) for paged serving, with Megatron-style tensor parallelism.

One decoder layer (do_layer_norm_before=True: 125m, 1.3b ... 175b; False: 350m):

    x ── LN ── qkv (column) ── paged attention ── out (row, all-reduce) ──(+x)── h
    h ── LN ── fc1 (column) ── relu ── fc2 (row, all-reduce) ──(+h)── next x

Positions are learned embeddings looked up at position + 2 (fairseq's padding offset).
Parameter names follow HF's `model.decoder.*` so the weight map below is nearly 1:1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rayserve_paged.ops.attention import AttentionMetadata

from .decoder import CausalLM
from .layers import (
    ACTIVATIONS,
    Attention,
    ColumnParallelLinear,
    KVCache,
    ParallelState,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

POSITION_OFFSET = 2  # OPT's learned positions start at row 2

_ACTIVATIONS = ("relu", "gelu", "gelu_new")
# checkpoint module -> (our fused module, shard id)
PACKED_MODULES = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}


@dataclass(frozen=True, slots=True)
class OPTConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    max_position_embeddings: int
    word_embed_proj_dim: int
    do_layer_norm_before: bool
    has_final_layer_norm: bool
    activation: str
    enable_bias: bool
    layer_norm_affine: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, c: dict) -> OPTConfig:
        hidden = c["hidden_size"]
        do_ln_before = c.get("do_layer_norm_before", True)
        activation = c.get("activation_function", "relu")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported OPT activation_function {activation!r}; supported: {list(_ACTIVATIONS)}")
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=hidden,
            num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            ffn_dim=c["ffn_dim"],
            max_position_embeddings=c["max_position_embeddings"],
            word_embed_proj_dim=c.get("word_embed_proj_dim") or hidden,
            do_layer_norm_before=do_ln_before,
            has_final_layer_norm=do_ln_before and not c.get("_remove_final_layer_norm", False),
            activation=activation,
            enable_bias=c.get("enable_bias", True),
            layer_norm_affine=c.get("layer_norm_elementwise_affine", True),
            tie_word_embeddings=c.get("tie_word_embeddings", True),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads  # multi-head attention: one KV head per query head


class OPTAttention(nn.Module):
    def __init__(self, cfg: OPTConfig, backend: Any, parallel: ParallelState, dtype: torch.dtype | None) -> None:
        super().__init__()
        head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, head_dim, cfg.num_heads, cfg.num_heads, bias=cfg.enable_bias, parallel=parallel, dtype=dtype
        )
        self.out_proj = RowParallelLinear(
            cfg.hidden_size, cfg.hidden_size, bias=cfg.enable_bias, parallel=parallel, dtype=dtype
        )
        self.scaling = head_dim**-0.5
        num_heads = self.qkv_proj.num_heads_per_rank
        # OPT scales q right after the projection (as fairseq and HF do), so the kernel gets 1.0.
        self.attn = Attention(num_heads, num_heads, head_dim, scale=1.0, backend=backend)

    def forward(self, hidden_states: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))  # [T, H/tp * D] each
        out = self.attn(q * self.scaling, k, v, kv_cache, attn_metadata)  # [T, H/tp * D]
        return self.out_proj(out)  # [T, hidden]


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: OPTConfig, backend: Any, parallel: ParallelState, dtype: torch.dtype | None) -> None:
        super().__init__()
        hidden, affine = cfg.hidden_size, cfg.layer_norm_affine
        self.do_layer_norm_before = cfg.do_layer_norm_before
        self.self_attn = OPTAttention(cfg, backend, parallel, dtype)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine, dtype=dtype)
        self.fc1 = ColumnParallelLinear(hidden, cfg.ffn_dim, bias=cfg.enable_bias, parallel=parallel, dtype=dtype)
        self.fc2 = RowParallelLinear(cfg.ffn_dim, hidden, bias=cfg.enable_bias, parallel=parallel, dtype=dtype)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine, dtype=dtype)
        self.activation = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        # x [T, hidden]
        h = self.self_attn_layer_norm(x) if self.do_layer_norm_before else x
        h = x + self.self_attn(h, kv_cache, attn_metadata)
        if not self.do_layer_norm_before:
            h = self.self_attn_layer_norm(h)
        y = self.final_layer_norm(h) if self.do_layer_norm_before else h
        y = h + self.fc2(self.activation(self.fc1(y)))  # fc1: [T, ffn/tp]
        return y if self.do_layer_norm_before else self.final_layer_norm(y)


class OPTDecoder(nn.Module):
    def __init__(self, cfg: OPTConfig, backend: Any, parallel: ParallelState, dtype: torch.dtype | None) -> None:
        super().__init__()
        hidden, proj = cfg.hidden_size, cfg.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, proj, parallel=parallel, dtype=dtype)
        # Replicated on every rank (positions are few and the lookup is per token).
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, hidden, dtype=dtype)
        self.project_in = nn.Linear(proj, hidden, bias=False, dtype=dtype) if proj != hidden else None
        self.project_out = nn.Linear(hidden, proj, bias=False, dtype=dtype) if proj != hidden else None
        self.final_layer_norm = (
            nn.LayerNorm(hidden, elementwise_affine=cfg.layer_norm_affine, dtype=dtype)
            if cfg.has_final_layer_norm
            else None
        )
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, backend, parallel, dtype) for _ in range(cfg.num_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, proj]
        if self.project_in is not None:
            x = self.project_in(x)  # [T, hidden]
        x = x + self.embed_positions(positions + POSITION_OFFSET)  # [T, hidden]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, attn_metadata)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # [T, proj]
        return x


class OPTModel(nn.Module):
    def __init__(self, cfg: OPTConfig, backend: Any, parallel: ParallelState, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg, backend, parallel, dtype)

    def forward(self, *args: Any) -> torch.Tensor:
        return self.decoder(*args)


class OPTForCausalLM(CausalLM):
    """forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, proj_dim]."""

    packed_modules = PACKED_MODULES  # checkpoint module -> (our fused module, shard id)

    @classmethod
    def config_from_hf(cls, hf_config: dict) -> OPTConfig:
        return OPTConfig.from_hf(hf_config)

    def build_model(
        self, cfg: OPTConfig, attn_backend: Any, parallel: ParallelState, dtype: torch.dtype | None
    ) -> OPTModel:
        return OPTModel(cfg, attn_backend, parallel, dtype)

    def embedding(self) -> VocabParallelEmbedding:
        return self.model.decoder.embed_tokens

    def map_weight_name(self, hf_name: str) -> tuple[str, Any] | None:
        if hf_name.startswith("decoder."):  # facebook/opt-* .bin files were saved from OPTModel
            hf_name = "model." + hf_name
        return super().map_weight_name(hf_name)
