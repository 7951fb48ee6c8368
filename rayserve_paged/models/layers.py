"""Model layers written for Megatron-style tensor parallelism.

Every parallel layer owns only this rank's shard of its parameters and knows how to cut
that shard out of the full Hugging Face tensor (`load_weight(param, full_tensor)`), so going
from one rank to several only needs `ParallelState(tp_rank, tp_size)`:

    ColumnParallelLinear   W [out, in] split by rows (output features); no communication
    RowParallelLinear      W [out, in] split by columns (input features); all-reduce of y
    VocabParallelEmbedding E [vocab, dim] split by rows (token ids); all-reduce of lookups
    ParallelLMHead         E [vocab, dim] split by rows; all-gather of the logits

A column-parallel layer followed by a row-parallel one (QKV -> out, up/gate -> down) needs a
single all-reduce per block. With tp_size 1 every collective is the identity.

How a layer holds its weight and multiplies by it is its LinearMethod (models/quant.py):
float weights by default; `set_method` swaps in a quantized format before loading. Every
weight parameter a method creates has the output features first and the input features
last, so the narrows below shard float weights, codes and group scales alike.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rayserve_paged.ops.attention import AttentionMetadata

from .quant import UNQUANTIZED, LinearMethod


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the tensor-parallel group and the two collectives layers need."""

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None = the default group

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad tensor-parallel rank {self.tp_rank} for size {self.tp_size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; the identity for one rank."""
        if self.tp_size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, rank order; the identity for one rank."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE_RANK = ParallelState()


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Raise ValueError naming both shapes; the loader adds the tensor's name."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"expected shape {list(expected)}, got {list(loaded.shape)}")


def copy_weight(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Load a replicated parameter (norms, learned positions): the full tensor, as is."""
    check_shape(loaded, tuple(param.shape))
    param.data.copy_(loaded)


def _new_param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


# --------------------------------------------------------------------------- linear layers


class LinearBase(nn.Module):
    """A layer whose weight [out per rank, in per rank] is held by a LinearMethod."""

    shard_ids: tuple | None = None  # pieces the full weight arrives in (None: one tensor)
    keeps_codes = False  # a quantized embedding looks rows up in its codes
    is_matmul = True  # multiplies by its weight (an embedding only when a tied LM head uses it)
    is_logits = False  # its products are logits (the LM head): kept in the model dtype
    lora_batch = None  # the model's LoRABatch once models/lora.py gave the layer adapter slots

    def _init_weight(self, output_size: int, input_size: int, dtype: torch.dtype | None) -> None:
        self.weight_shape = (output_size, input_size)
        self.params_dtype = dtype
        self.method: LinearMethod = UNQUANTIZED
        UNQUANTIZED.create_weights(self, output_size, input_size, dtype)

    def set_method(self, method: LinearMethod) -> None:
        """Replace the weight format (before loading): the old parameters go, the new come."""
        for name in self.method.param_names:
            delattr(self, name)
        self.method = method
        method.create_weights(self, *self.weight_shape, self.params_dtype)

    def is_weight(self, param: nn.Parameter) -> bool:
        return any(param is getattr(self, name) for name in self.method.param_names)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)  # [T, out per rank]
        lora = self.lora_batch
        if lora is not None and lora.is_active:  # each row's adapter, before any all-reduce
            y = lora.apply(y, x, self.lora_a, self.lora_b)
        return y


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b, W [output_size, input_size] split by rows over the ranks.

    Rank r holds rows [r * out/tp, (r+1) * out/tp); its output is that slice of y's features.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        parallel: ParallelState = SINGLE_RANK,
        gather_output: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = divide(output_size, parallel.tp_size, "output size")
        self.gather_output = gather_output
        self._init_weight(self.output_size_per_rank, input_size, dtype)  # [out/tp, in]
        self.bias = _new_param(self.output_size_per_rank, dtype=dtype) if bias else None  # [out/tp]

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """`loaded` is the full HF weight [out, in] or bias [out]; keep this rank's rows."""
        check_shape(loaded, (self.output_size, *param.shape[1:]))
        rows = self.output_size_per_rank
        param.data.copy_(loaded.narrow(0, self.parallel.tp_rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)  # [T, out/tp]
        if self.bias is not None:
            y = y + self.bias
        return self.parallel.all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate + up).

    Each rank's weight is the concatenation of its shard of every piece:
        [ piece 0 rows of rank r | piece 1 rows of rank r | ... ]
    so splitting the output by `output_sizes / tp` gives each projection's local part.
    """

    def __init__(self, input_size: int, output_sizes: list[int], **kwargs: Any) -> None:
        super().__init__(input_size, sum(output_sizes), **kwargs)
        tp_size = self.parallel.tp_size
        self.output_sizes = list(output_sizes)
        self.sizes_per_rank = [divide(size, tp_size, "output size") for size in output_sizes]
        self.shard_ids = tuple(range(len(output_sizes)))

    def split_fused(self, loaded: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A checkpoint tensor holding every piece (Phi-3's gate_up_proj): the pieces, in order."""
        return loaded.split(self.output_sizes, dim=0)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        """`loaded` is piece `shard_id`'s full HF weight [size_i, in] or bias [size_i]."""
        check_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        rows = self.sizes_per_rank[shard_id]
        offset = sum(self.sizes_per_rank[:shard_id])
        shard = loaded.narrow(0, self.parallel.tp_rank * rows, rows)
        param.data.narrow(0, offset, rows).copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; each rank holds its query heads and its key/value heads.

    Per rank, output features are [ q: H/tp * D | k: Hkv/tp * D | v: Hkv/tp * D ].
    When tp_size > num_kv_heads, each KV head is replicated on tp_size / num_kv_heads ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        parallel: ParallelState = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp_size = parallel.tp_size
        num_heads_per_rank = divide(num_heads, tp_size, "number of attention heads")
        if num_kv_heads >= tp_size:
            num_kv_heads_per_rank = divide(num_kv_heads, tp_size, "number of KV heads")
            num_kv_replicas = 1
        else:
            if tp_size % num_kv_heads != 0:
                raise ValueError(f"tensor-parallel size {tp_size} is not a multiple of {num_kv_heads} KV heads")
            num_kv_heads_per_rank = 1
            num_kv_replicas = tp_size // num_kv_heads
        # Replicated KV heads are counted once per holding rank in the global output size.
        global_out = (num_heads_per_rank + 2 * num_kv_heads_per_rank) * head_dim * tp_size
        super().__init__(hidden_size, global_out, bias=bias, parallel=parallel, dtype=dtype)
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_heads_per_rank = num_heads_per_rank
        self.num_kv_heads_per_rank = num_kv_heads_per_rank
        self.num_kv_replicas = num_kv_replicas
        self.q_size = self.num_heads_per_rank * head_dim
        self.kv_size = self.num_kv_heads_per_rank * head_dim
        self.shard_ids = ("q", "k", "v")

    def split_fused(self, loaded: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A checkpoint tensor holding q, k and v (Phi-3's qkv_proj): the three, in order."""
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return loaded.split([q_rows, kv_rows, kv_rows], dim=0)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """`loaded` is the full HF q_proj / k_proj / v_proj weight [heads * D, hidden] or bias."""
        rank = self.parallel.tp_rank
        if shard_id == "q":
            full_heads, offset, rows, head_start = self.num_heads, 0, self.q_size, rank * self.num_heads_per_rank
        else:
            full_heads = self.num_kv_heads
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            rows = self.kv_size
            head_start = (rank // self.num_kv_replicas) * self.num_kv_heads_per_rank
        check_shape(loaded, (full_heads * self.head_dim, *param.shape[1:]))
        shard = loaded.narrow(0, head_start * self.head_dim, rows)
        param.data.narrow(0, offset, rows).copy_(shard)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [T, q_size + 2 * kv_size] -> [T, q_size], [T, kv_size], [T, kv_size]
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """y = x W^T + b, W [output_size, input_size] split by columns over the ranks.

    The input arrives already split by features (the output of a column-parallel layer); each
    rank computes a partial y, summed by one all-reduce. The bias is added once, after it.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        parallel: ParallelState = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = divide(input_size, parallel.tp_size, "input size")
        self._init_weight(output_size, self.input_size_per_rank, dtype)  # [out, in/tp]
        self.bias = _new_param(output_size, dtype=dtype) if bias else None  # [out], replicated

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """`loaded` is the full HF weight [out, in] (keep this rank's columns) or bias [out].

        A weight parameter's last dim is this rank's share of the input features (or of their
        groups, for group scales): rank r keeps columns [r * cols, (r+1) * cols). One value
        per output feature (a method's `is_per_output` parameter: FP8 scales) is kept whole."""
        if param is self.bias or getattr(param, "is_per_output", False):
            copy_weight(param, loaded)
            return
        cols = param.shape[1]
        check_shape(loaded, (self.output_size, cols * self.parallel.tp_size))
        param.data.copy_(loaded.narrow(1, self.parallel.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce(self.matmul(x))  # [T, out]
        return y + self.bias if self.bias is not None else y


# --------------------------------------------------------------------------- vocabulary


class VocabParallelEmbedding(LinearBase):
    """Token embedding E [vocab, dim] split by rows; rank r holds ids [start, end).

    The vocabulary is padded up to a multiple of tp_size; padded rows are zero and never
    looked up. Each rank embeds the ids it owns, zeros the others, and an all-reduce sums.
    """

    keeps_codes = True
    is_matmul = False
    is_logits = True  # the weight of a tied LM head

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        parallel: ParallelState = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_rank = math.ceil(num_embeddings / parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self._init_weight(self.num_embeddings_per_rank, embedding_dim, dtype)  # [V/tp, dim]

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """`loaded` is the full HF embedding [vocab, dim] (or its codes / group scales); keep
        this rank's rows, zero padding."""
        check_shape(loaded, (self.num_embeddings, *param.shape[1:]))
        num_rows = self.vocab_end - self.vocab_start
        param.data.zero_()
        param.data[:num_rows].copy_(loaded[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self.method.embed(self, input_ids)  # [T, dim]
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [T]
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        embeds = self.method.embed(self, local_ids) * is_local.unsqueeze(-1)  # [T, dim]
        return self.parallel.all_reduce(embeds)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection [vocab, dim] split by rows, like the embedding it may share.

    With `tied_to=embedding` (tied word embeddings) the head has no weight of its own: it
    multiplies by the embedding's (each rank keeps one copy of its vocabulary shard, used
    both ways, in whatever format the embedding's method holds it).
    """

    keeps_codes = False
    is_matmul = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        parallel: ParallelState = SINGLE_RANK,
        dtype: torch.dtype | None = None,
        tied_to: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, parallel=parallel, dtype=dtype)
        self.tied_to = (tied_to,) if tied_to is not None else ()  # a tuple: not a submodule
        if tied_to is not None:
            assert tied_to.weight_shape == self.weight_shape, "tied embedding of another shape"
            tied_to.is_matmul = True
            for name in self.method.param_names:
                delattr(self, name)

    def set_method(self, method: LinearMethod) -> None:
        if self.tied_to:
            raise ValueError("a tied LM head takes the embedding's weight format; set the embedding's")
        super().set_method(method)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        owner = self.tied_to[0] if self.tied_to else self
        local = owner.matmul(hidden_states)  # [n, V/tp]
        logits = self.parallel.all_gather(local)  # [n, V padded to a multiple of tp]
        return logits[:, : self.num_embeddings].float()  # [n, vocab] float32

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)


KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache), each [blocks, block_size, Hkv, D]

# HF `hidden_act` / `activation_function` names -> the function
ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str, what: str = "hidden_act"):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported {what} {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


# --------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 as Llama does.

    With `weight_offset` 1.0 (Gemma) the checkpoint stores w - 1 and y = (1 + w) * x / rms,
    multiplied in float32 before the cast back, as Gemma's modeling does.

    `forward(x, residual)` fuses the residual add that precedes every norm in a pre-norm
    block: it returns (norm(x + residual), x + residual).

    float32 on the CPU (activations and weight, no offset) runs torch.rms_norm: one op
    instead of six, bit for bit the same values as the formula (tests/models/test_norm.py).
    """

    shard_ids: tuple | None = None

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, *, dtype: torch.dtype | None = None, weight_offset: float = 0.0
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param, loaded)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype == torch.float32 and weight.dtype == torch.float32 and not self.weight_offset and x.device.type == "cpu":
            return torch.rms_norm(x, weight.shape, weight, self.eps)
        return self._norm_formula(x)

    def _norm_formula(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (x32 * (self.weight_offset + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


# --------------------------------------------------------------------------- rotary


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# the types whose frequencies depend on the length of the forward that computes a token
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
# How a model's length-dependent RoPE (dynamic NTK, LongRoPE) picks each token's length: the
# length of the forward in which transformers' `generate` computes the token.
ROPE_LEN_PER_TOKEN = "token"  # max(num_prompt_tokens, position + 1): one prefill, then one per token
# Phi-3: the sequence's length at the step, for every token of the row (its `generate` re-encodes
# the whole sequence when it first passes original_max_position_embeddings, which the scheduler
# mirrors with a recompute, so every cached key has the frequencies of the longest length)
ROPE_LEN_PER_SEQUENCE = "sequence"


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE settings from an HF config, whichever key style it uses."""

    rope_type: str = "default"  # one of ROPE_TYPES
    theta: float = 10000.0
    factor: float = 1.0  # longrope: max_position_embeddings / original when the config has none
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope
    max_position_embeddings: int = 8192  # dynamic: the length past which the base grows
    # longrope only: per-dimension divisors of the inverse frequencies, up to and past
    # original_max_position_embeddings
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    # per-dimension divisors of the inverse frequencies, as GGUF files store llama3 scaling
    # (the `rope_freqs` tensor); applied on top of rope_type
    freq_factors: tuple[float, ...] | None = None
    # yarn only (None: transformers' defaults)
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def is_length_dependent(self) -> bool:
        """Whether a token's frequencies depend on the length of the forward computing it
        (see RotaryEmbedding); such a model needs `AttentionMetadata.rope_lens`."""
        return self.rope_type in LENGTH_DEPENDENT_ROPE_TYPES


def rope_scaling_from_hf(config: dict) -> RopeScaling:
    """Read RoPE settings from a config.json dict.

    transformers 5 writes `rope_parameters: {rope_type, rope_theta, factor, ...}`; older
    configs write `rope_theta` at top level and `rope_scaling: {type|rope_type, factor, ...}`
    (or null). A top-level `rope_theta` fills a `rope_parameters` dict that lacks one; for the
    types that read it, a top-level `original_max_position_embeddings` (Phi-3 writes it there)
    wins over the dict's, as in transformers.
    """
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    max_len = config.get("max_position_embeddings", 8192)
    original = params.get("original_max_position_embeddings", max_len)
    if rope_type in ("llama3", "yarn", "longrope") and config.get("original_max_position_embeddings"):
        original = config["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_len / original if rope_type == "longrope" else 1.0
    return RopeScaling(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        max_position_embeddings=int(max_len),
        short_factor=_float_tuple(params.get("short_factor")),
        long_factor=_float_tuple(params.get("long_factor")),
        freq_factors=_float_tuple(params.get("freq_factors")),
        **{key: params[key] for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                        "truncate") if params.get(key) is not None},
    )  # fmt: skip


def _float_tuple(values) -> tuple[float, ...] | None:
    return tuple(float(v) for v in values) if values else None


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]


def rope_inv_freq(head_dim: int, rope: RopeScaling) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] float32, as transformers computes them (for the
    length-dependent types, those of a forward up to the threshold length: LongRoPE's short
    factors, dynamic NTK's unscaled base)."""
    if rope.rope_type == "longrope":
        return longrope_inv_freq(head_dim, rope, rope.short_factor, "short_factor")
    exponents = _exponents(head_dim)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != head_dim // 2:
            raise ValueError(f"{len(rope.freq_factors)} RoPE frequency factors for head_dim {head_dim}")
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope)
    if rope.rope_type == "dynamic":  # the base at max_position_embeddings, in Python floats
        f, max_len = rope.factor, rope.max_position_embeddings
        base = rope.theta * ((f * max_len / max_len) - (f - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** exponents)
    return inv_freq


def longrope_inv_freq(head_dim: int, rope: RopeScaling, factors: tuple[float, ...] | None, what: str) -> torch.Tensor:
    """LongRoPE (Phi-3 128k): 1 / (factor_i * theta ** (2i / D)), as transformers computes it."""
    if factors is None or len(factors) != head_dim // 2:
        got = "none" if factors is None else len(factors)
        raise ValueError(f"longrope RoPE needs {what} with head_dim / 2 = {head_dim // 2} entries, got {got}")
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** _exponents(head_dim))


def dynamic_max_len(rope: RopeScaling) -> int:
    """The longest sequence a dynamic-NTK model serves by default: max_position_embeddings x
    factor (as vLLM derives it)."""
    return max(rope.max_position_embeddings, math.ceil(rope.max_position_embeddings * rope.factor))


@functools.lru_cache(maxsize=8)
def dynamic_inv_freq_table(
    head_dim: int, rope: RopeScaling, max_len: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Dynamic NTK inverse frequencies [max_len + 1, D/2] float32, row L for a forward of
    length L: the unscaled ones up to max_position_embeddings, above it the base
    theta * (factor * L / max - (factor - 1)) ** (D / (D - 2)).

    Each row is computed as transformers computes it, on 0-d float32 tensors (a batched pow
    rounds differently in the last bit), once per model: a lookup by length is exact and
    capturable in a CUDA graph. One table per settings and device, shared by the layers."""
    if str(device) != "cpu":
        return dynamic_inv_freq_table(head_dim, rope, max_len).to(device)
    f, max_pos = rope.factor, rope.max_position_embeddings
    exponents = _exponents(head_dim)
    rows = [rope_inv_freq(head_dim, rope)] * (min(max_pos, max_len) + 1)
    for length in range(max_pos + 1, max_len + 1):
        seq_len = torch.tensor(length)  # int64, as transformers' max(position_ids) + 1
        base = rope.theta * ((f * seq_len / max_pos) - (f - 1)) ** (head_dim / (head_dim - 2))
        rows.append(1.0 / (base**exponents))
    return torch.stack(rows)  # [max_len + 1, D/2]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_scaling(rope: RopeScaling) -> float:
    """The factor on cos / sin (YaRN's and LongRoPE's attention factor; 1 for the other types)."""
    if rope.rope_type == "longrope":
        if rope.attention_factor is not None:
            return rope.attention_factor
        if rope.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def _yarn_inv_freq(head_dim: int, rope: RopeScaling) -> torch.Tensor:
    """YaRN (Peng et al. 2023): interpolated frequencies below the correction range, the
    original ones above it, a linear ramp between, as transformers computes them."""
    base, dim, old_len = rope.theta, head_dim, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast or 32), correction_dim(rope.beta_slow or 1)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # [D/2]
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths / factor, short ones kept, a smooth ramp between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, "rotate half" (GPT-NeoX / HF Llama) layout.

    cos/sin are computed per step from the positions (T x D/2 work, no max-length cache), in
    float32 exactly as transformers does, then cast to the activations' dtype. Between
    `begin_step()` and `end_step()` (the decoder's forward; its layers share one instance per
    distinct RoPE) they are computed once, at the first layer, and reused by the others: the
    same positions give the same cos/sin, so 29 of 30 layers skip ~10 small ops. The inverse
    frequencies are not a buffer, so `model.half()` cannot round them; they follow the
    positions' device on first use.

    Length-dependent types (`dynamic`, `longrope`) take each token's RoPE length [T]: in
    transformers' `generate` a token's frequencies are those of the forward that computed it,
    whose length is the prompt's for prompt tokens and p + 1 for the token generated at
    position p, so rope_len(p) = max(num_prompt_tokens, p + 1), however the engine chunks or
    recomputes. LongRoPE takes its long factors where rope_len > original_max_position_embeddings;
    dynamic NTK grows the base where rope_len > max_position_embeddings.
    """

    def __init__(self, head_dim: int, rope: RopeScaling) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.inv_freq = rope_inv_freq(head_dim, rope)  # [D/2] float32
        self.attention_scaling = rope_attention_scaling(rope)
        self.is_length_dependent = rope.is_length_dependent
        if rope.rope_type == "longrope":
            self.long_inv_freq = longrope_inv_freq(head_dim, rope, rope.long_factor, "long_factor")  # [D/2]
        if rope.rope_type == "dynamic":
            self.inv_freq_table = dynamic_inv_freq_table(head_dim, rope, dynamic_max_len(rope))  # [L + 1, D/2]
        # (positions, rope_lens, dtype, cos, sin) of the step under way; None outside a step
        self._step_cos_sin: tuple | None = None
        self._in_step = False

    def begin_step(self) -> None:
        """A forward begins: the first call computes cos/sin, later calls with the same
        positions and rope_lens tensors reuse them (the caller does not write them in place
        within the step)."""
        self._in_step, self._step_cos_sin = True, None

    def end_step(self) -> None:
        self._in_step, self._step_cos_sin = False, None

    def _token_inv_freq(self, rope_lens: torch.Tensor) -> torch.Tensor:
        """[T, D/2] inverse frequencies of tokens whose RoPE lengths are rope_lens [T]."""
        rope = self.rope
        if rope.rope_type == "longrope":
            if self.long_inv_freq.device != rope_lens.device:
                self.long_inv_freq = self.long_inv_freq.to(rope_lens.device)
            is_long = (rope_lens > rope.original_max_position_embeddings)[:, None]  # [T, 1]
            return torch.where(is_long, self.long_inv_freq[None, :], self.inv_freq[None, :])
        if self.inv_freq_table.device != rope_lens.device:
            self.inv_freq_table = dynamic_inv_freq_table(self.head_dim, rope, dynamic_max_len(rope), rope_lens.device)
        return self.inv_freq_table[rope_lens]  # rope_lens <= max_model_len <= the table's last row

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, rope_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; query [T, H, D]; key [T, Hkv, D]; rope_lens [T] (length-dependent types)
        memo = self._step_cos_sin
        if memo is None or memo[0] is not positions or memo[1] is not rope_lens or memo[2] != query.dtype:
            cos, sin = self.cos_sin(positions, rope_lens, query.dtype)
            memo = (positions, rope_lens, query.dtype, cos, sin)
            if self._in_step:
                self._step_cos_sin = memo
        return _rotate(query, memo[3], memo[4]), _rotate(key, memo[3], memo[4])

    def cos_sin(
        self, positions: torch.Tensor, rope_lens: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] in `dtype`."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        if self.is_length_dependent:
            if rope_lens is None:
                raise ValueError(f"{self.rope.rope_type} RoPE needs each token's RoPE length (metadata.rope_lens)")
            freqs = positions.float()[:, None] * self._token_inv_freq(rope_lens)  # [T, D/2]
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)  # [T, 1, D] each


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, H, D]
    return x * cos + rotated * sin


# --------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """Paged attention over this rank's heads; the kernel comes from the attention backend.

    The backend writes the step's new K/V into the cache (slot_mapping) and attends over the
    cached context plus the new tokens (the last `sliding_window` positions of it, when set);
    the layer only reshapes around it.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: Any,
        *,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads  # per rank
        self.num_kv_heads = num_kv_heads  # per rank
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window  # keys older than this many positions are masked
        self.soft_cap = soft_cap  # attention logits s -> soft_cap * tanh(s / soft_cap)
        if hasattr(backend, "add_layer"):
            backend.add_layer(sliding_window, soft_cap)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        key_cache, value_cache = kv_cache  # each [num_blocks, block_size, Hkv, D]
        out = self.backend.forward(
            query, key, value, key_cache, value_cache, attn_metadata, self.scale, self.sliding_window, self.soft_cap
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)  # [T, H * D]
