"""One decoder skeleton for the Llama-shaped families; each family's file says what differs.

    tokens ── embed (× embed_scale) ── N × layer ── RMSNorm ── LM head (── final soft-cap)

    layer (pre-norm, the residual add fused into the next RMSNorm):
    x ── RMSNorm ── qkv (column, ±bias) ── [q/k RMSNorm per head] ── RoPE(q, k)
      ── paged attention (scale, ±sliding window, ±logit soft-cap) ── o (row, ±bias) ── +x
      ── RMSNorm ── gate|up (column) ── act(gate) * up ── down (row) ── +

A family is a `DecoderForCausalLM` subclass: `config_from_hf` maps its config.json onto a
`DecoderConfig` (the flags below), and class attributes name the attention / MLP / layer
classes it swaps in and the checkpoint's packed modules (`packed_modules`: checkpoint module
name -> (our fused module, shard id)), which drive the one weight-name mapper. Every linear
layer is a models/layers.py parallel linear, so its weight format (float or quantized) is its
LinearMethod's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from rayserve_paged.ops.attention import AttentionMetadata

from .compiled_decode import CompiledDecode
from .layers import (
    ROPE_LEN_PER_SEQUENCE,
    ROPE_LEN_PER_TOKEN,
    SINGLE_RANK,
    Attention,
    KVCache,
    MergedColumnParallelLinear,
    ParallelLMHead,
    ParallelState,
    QKVParallelLinear,
    RMSNorm,
    RopeScaling,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    activation,
    rope_scaling_from_hf,
)

FULL, SLIDING = "full_attention", "sliding_attention"  # HF `layer_types` values
LAYER_TYPES = (FULL, SLIDING)
LayerT = TypeVar("LayerT", bound=nn.Module)


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """What the skeleton builds; the flags are where families differ."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeScaling
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projections (Qwen2: True)
    o_bias: bool = False  # output projection, separately (Qwen2: False while q/k/v have one)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm weights stored as w - 1
    embed_scale: float | None = None  # Gemma: embeddings × sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_soft_cap: float | None = None  # attention logits (Gemma 2: 50)
    final_soft_cap: float | None = None  # output logits (Gemma 2: 30)
    sliding_window: int | None = None  # positions a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer FULL | SLIDING; () = all FULL
    local_rope: RopeScaling | None = None  # RoPE of sliding layers when it differs (Gemma 3)
    # a sequence reaching this length is re-encoded whole (Phi-3 LongRoPE: its original
    # length + 1); its tokens' RoPE length is then the sequence's (ROPE_LEN_PER_SEQUENCE)
    rope_recompute_len: int | None = None

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"unsupported layer_types {sorted(set(bad))}; supported: {', '.join(LAYER_TYPES)}")
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"sliding layers need a positive sliding_window, got {self.sliding_window!r}")

    def is_sliding(self, layer_idx: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_idx] == SLIDING

    def window_of(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer_idx) else None

    @property
    def is_rope_length_dependent(self) -> bool:
        """A layer's RoPE needs each token's RoPE length (dynamic NTK, LongRoPE)."""
        return self.rope.is_length_dependent or (self.local_rope is not None and self.local_rope.is_length_dependent)

    @property
    def rope_len_rule(self) -> str | None:
        """How the runner gives each token its RoPE length (None: the RoPE needs none)."""
        if not self.is_rope_length_dependent:
            return None
        return ROPE_LEN_PER_SEQUENCE if self.rope_recompute_len is not None else ROPE_LEN_PER_TOKEN

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, its sliding window or None (full attention)."""
        return tuple(self.window_of(i) for i in range(self.num_layers))


def decoder_config_from_hf(c: dict, **overrides: Any) -> DecoderConfig:
    """The fields every Llama-shaped config.json spells the same way; a family overrides the rest.

    `layer_types` comes from the config when it has them (transformers writes them for the
    families with sliding layers); otherwise from `overrides`, else all full attention.
    """
    num_heads = c["num_attention_heads"]
    bias = bool(c.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=c.get("num_key_value_heads") or num_heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
        intermediate_size=c["intermediate_size"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope=rope_scaling_from_hf(c),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(c.get("mlp_bias", False)),
        hidden_act=c.get("hidden_act") or "silu",
        sliding_window=c.get("sliding_window"),
    )
    fields.update(overrides)
    if c.get("layer_types"):
        fields["layer_types"] = tuple(c["layer_types"])
    if fields.get("sliding_window") is not None and SLIDING not in fields.get("layer_types", ()):
        fields["sliding_window"] = None  # a window no layer uses
    activation(fields["hidden_act"])  # unsupported activations fail here, naming the field
    return DecoderConfig(**fields)


@dataclass(frozen=True, slots=True)
class DecoderContext:
    """What every module of one model is built with (instead of threading it through)."""

    config: DecoderConfig
    backend: Any
    parallel: ParallelState
    dtype: torch.dtype | None
    attention_class: type[nn.Module]
    mlp_class: type[nn.Module]
    rotary: dict = field(default_factory=dict)  # (head_dim, rope) -> the layers' shared RotaryEmbedding

    def sharded(self, layer_class: type[LayerT], *sizes: Any, **options: Any) -> LayerT:
        """A models/layers.py parallel layer (linear, embedding) on this model's ranks, in its dtype."""
        return layer_class(*sizes, parallel=self.parallel, dtype=self.dtype, **options)

    def norm(self, size: int) -> RMSNorm:
        cfg = self.config
        return RMSNorm(size, cfg.rms_norm_eps, dtype=self.dtype, weight_offset=cfg.norm_weight_offset)

    def rotary_embedding(self, head_dim: int, rope: RopeScaling) -> RotaryEmbedding:
        """One instance per distinct RoPE, shared by the layers that use it: within a forward
        it computes cos/sin once (RotaryEmbedding.begin_step)."""
        key = (head_dim, rope)
        if key not in self.rotary:
            self.rotary[key] = RotaryEmbedding(head_dim, rope)
        return self.rotary[key]


class DecoderAttention(nn.Module):
    def __init__(self, ctx: DecoderContext, layer_idx: int) -> None:
        super().__init__()
        cfg = ctx.config
        d = cfg.head_dim
        self.qkv_proj = ctx.sharded(
            QKVParallelLinear, cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, bias=cfg.qkv_bias
        )
        self.o_proj = ctx.sharded(RowParallelLinear, cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias)
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.head_dim = d
        if cfg.qk_norm:  # one [head_dim] weight shared by every head: replicated on every rank
            self.q_norm, self.k_norm = ctx.norm(d), ctx.norm(d)
        rope = cfg.local_rope if cfg.local_rope is not None and cfg.is_sliding(layer_idx) else cfg.rope
        self.rotary_emb = ctx.rotary_embedding(d, rope)
        scale = cfg.attn_scale if cfg.attn_scale is not None else d**-0.5
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, d, scale=scale, backend=ctx.backend,
            sliding_window=cfg.window_of(layer_idx), soft_cap=cfg.attn_soft_cap,
        )  # fmt: skip

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H/tp, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv/tp, D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k, attn_metadata.rope_lens)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [T, H/tp * D]
        return self.o_proj(out)  # [T, hidden]


class DecoderMLP(nn.Module):
    def __init__(self, ctx: DecoderContext, layer_idx: int) -> None:
        super().__init__()
        cfg = ctx.config
        size = cfg.intermediate_size
        self.gate_up_proj = ctx.sharded(MergedColumnParallelLinear, cfg.hidden_size, [size, size], bias=cfg.mlp_bias)
        self.down_proj = ctx.sharded(RowParallelLinear, size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I/tp] each
        return self.down_proj(self.act(gate) * up)  # [T, hidden]


class DecoderLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, ctx: DecoderContext, layer_idx: int) -> None:
        super().__init__()
        hidden = ctx.config.hidden_size
        self.input_layernorm = ctx.norm(hidden)
        self.self_attn = ctx.attention_class(ctx, layer_idx)
        self.post_attention_layernorm = ctx.norm(hidden)
        self.mlp = ctx.mlp_class(ctx, layer_idx)

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


class DecoderModel(nn.Module):
    def __init__(self, ctx: DecoderContext, layer_class: type[nn.Module]) -> None:
        super().__init__()
        cfg = ctx.config
        self.embed_tokens = ctx.sharded(VocabParallelEmbedding, cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_class(ctx, i) for i in range(cfg.num_layers))
        self.norm = ctx.norm(cfg.hidden_size)
        self.rotaries = tuple(ctx.rotary.values())  # each computes cos/sin once per forward
        self.config = cfg
        self.use_compiled_decode = True  # decode steps through models/compiled_decode.py when the model qualifies
        self._compiled: CompiledDecode | None | object = UNDECIDED
        # as HF does: the scale rounded to the model dtype first
        scale = cfg.embed_scale
        self.embed_scale = None if scale is None else float(torch.tensor(scale, dtype=ctx.dtype or torch.float32))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        residual = None
        compiled = self._compiled_decode()
        if compiled is not None and compiled.can_run(attn_metadata, kv_caches):
            x, residual = compiled.forward(x, positions, kv_caches, attn_metadata)
        else:
            for rotary in self.rotaries:
                rotary.begin_step()
            try:
                for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                    x, residual = layer(positions, x, residual, kv_cache, attn_metadata)
            finally:
                for rotary in self.rotaries:
                    rotary.end_step()
        x, _ = self.norm(x, residual)
        return x  # [T, hidden]

    def _compiled_decode(self) -> CompiledDecode | None:
        """Decided at the first forward, once the weights are in their final form."""
        if self._compiled is UNDECIDED:
            skeleton = (DecoderLayer, DecoderAttention, DecoderMLP)
            self._compiled = CompiledDecode.for_model(self, skeleton) if self.use_compiled_decode else None
        return self._compiled


UNDECIDED = object()


# checkpoint module -> (our fused module, shard id): q/k/v into qkv_proj, gate/up into gate_up_proj
SEPARATE_PROJECTIONS: dict[str, tuple[str, Any]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def map_packed_name(
    hf_name: str, packed_modules: dict[str, tuple[str, Any]], tie_word_embeddings: bool
) -> tuple[str, Any] | None:
    """HF checkpoint name -> (our parameter name, shard id), or None to skip it; the one
    mapper of every model, driven by its packed-modules table."""
    if "rotary_emb.inv_freq" in hf_name:  # a buffer some old checkpoints saved
        return None
    if hf_name == "lm_head.weight" and tie_word_embeddings:
        return None  # the embedding, again
    parts = hf_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in packed_modules:
            fused, shard_id = packed_modules[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id
    return hf_name, None


class CausalLM(nn.Module):
    """What every family's model is: a body (`build_model`) whose token embedding
    (`embedding()`) the LM head may be tied to, the head, and the weight-name mapper.

    forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, the
    embedding's width]; compute_logits(hidden [n, width]) -> [n, vocab] float32.
    """

    packed_modules: ClassVar[dict[str, tuple[str, Any]]] = SEPARATE_PROJECTIONS

    @classmethod
    def config_from_hf(cls, hf_config: dict) -> Any:
        raise NotImplementedError

    def build_model(self, cfg: Any, attn_backend: Any, parallel: ParallelState, dtype: torch.dtype | None) -> nn.Module:
        raise NotImplementedError

    def embedding(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def __init__(
        self,
        hf_config: dict,
        attn_backend: Any,
        parallel: ParallelState = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = self.config_from_hf(hf_config)
        cfg = self.config
        self.model = self.build_model(cfg, attn_backend, parallel, dtype)
        embed = self.embedding()
        tied = embed if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, embed.embedding_dim, parallel=parallel, dtype=dtype, tied_to=tied)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)  # [n, vocab] float32

    def map_weight_name(self, hf_name: str) -> tuple[str, Any] | None:
        """HF checkpoint name -> (our parameter name, shard id), or None to skip it."""
        return map_packed_name(hf_name, self.packed_modules, self.config.tie_word_embeddings)


class DecoderForCausalLM(CausalLM):
    """The Llama-shaped skeleton. Subclasses (one per family) override `config_from_hf` and,
    where their layers differ, the class attributes below.
    """

    attention_class: ClassVar[type[nn.Module]] = DecoderAttention
    mlp_class: ClassVar[type[nn.Module]] = DecoderMLP
    layer_class: ClassVar[type[nn.Module]] = DecoderLayer

    @classmethod
    def config_from_hf(cls, hf_config: dict) -> DecoderConfig:
        return decoder_config_from_hf(hf_config)

    def build_model(
        self, cfg: DecoderConfig, attn_backend: Any, parallel: ParallelState, dtype: torch.dtype | None
    ) -> DecoderModel:
        ctx = DecoderContext(cfg, attn_backend, parallel, dtype, self.attention_class, self.mlp_class)
        return DecoderModel(ctx, self.layer_class)

    @property
    def rope_len_rule(self) -> str | None:
        return self.config.rope_len_rule  # the runner builds metadata.rope_lens by it

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)  # [n, vocab] float32
        cap = self.config.final_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
