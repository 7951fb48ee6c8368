"""Decode steps of a group-quantized decoder on the CPU, one compiled call per layer.

DecoderModel.forward hands a decode-only step (every token one sequence's next token) to
`CompiledDecode.forward` when the model qualified at its first forward; every other step, and
every model that does not qualify, runs its layers op by op. The compiled layer
(ops/cpu_layer.py) is the op-by-op layer's norm, projections, RoPE, cache write, attention
and SwiGLU in C++, with the same GEMM and attention kernels, so the two paths compute the same
values up to float32 summation order (tests/models/test_compiled_decode.py).

A model qualifies (checked once; the reason is logged once when it does not) when it is the
skeleton's own layer, attention and MLP (a family that swaps one in, e.g. Gemma 2's extra
norms, does not), with silu, no q/k norms and no norm weight offset, on one rank, float32 on
the CPU, every projection held by the compiled group-quantized kernel (`quantization: auto` on
a CPU with AVX-512), and the torch attention backend decoding with its compiled kernel. A step
runs compiled when it has no prefill token and no padding token and none of its rows uses a
LoRA adapter (LoRA enabled or not: a LoRA engine's base-only steps run compiled too). A step
that verifies speculative drafts comes here as one-token rows (worker/static_decode.py
`expanded_draft_rows`): the layer writes every row's K/V before any row attends, so row j of
a sequence sees rows < j of the same step.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from rayserve_paged.ops import cpu_layer
from rayserve_paged.ops.attention import AttentionMetadata

logger = logging.getLogger(__name__)

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class CompiledDecode:
    """The compiled decode path of one DecoderModel (module docstring)."""

    def __init__(self, model: nn.Module, kernel: cpu_layer.DecoderLayerKernel) -> None:
        self.model = model
        self.kernel = kernel
        self.linears = tuple(_projections(layer)[name] for layer in model.layers for name in PROJECTIONS)
        self._caches_key: tuple | None = None
        self._layers: list[cpu_layer.DecodeLayer] | None = None

    @classmethod
    def for_model(cls, model: nn.Module, skeleton: tuple[type, type, type]) -> CompiledDecode | None:
        """The model's compiled decode path, or None (one log line saying why).
        `skeleton`: the (layer, attention, MLP) classes the compiled layer computes."""
        reason = _why_not(model, skeleton)
        kernel = cpu_layer.load() if reason is None else None
        if reason is None and kernel is None:
            reason = "the compiled CPU decoder layer is unavailable"
        if reason is not None:
            if _is_group_quantized_cpu(model):
                logger.info("decode steps run layer by layer: %s", reason)
            return None
        return cls(model, kernel)

    def can_run(self, metadata: AttentionMetadata, kv_caches: list) -> bool:
        """A decode-only step without padding tokens, no row on an adapter, caches the attention
        backend decodes with its compiled kernel."""
        if metadata.num_prefill_tokens or metadata.num_decode_tokens != metadata.slot_mapping.shape[0]:
            return False
        if any(lin.lora_batch is not None and lin.lora_batch.is_active for lin in self.linears):
            return False  # a row of this step uses an adapter (base-only steps of a LoRA engine run here)
        return self._decode_layers(kv_caches) is not None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] embeddings -> (the last layer's output, its residual), as the layer loop returns them."""
        layers = self._decode_layers(kv_caches)  # can_run made them
        backend = self.model.layers[0].self_attn.attn.backend
        tables, seq_lens = backend.step_plan(metadata).kernel_inputs()
        slots = metadata.slot_mapping.contiguous()
        hidden = x.shape[1]
        steps = {}
        for rotary in self.model.rotaries:  # one per distinct RoPE; cos/sin [T, D] float32
            cos, sin = rotary.cos_sin(positions, metadata.rope_lens, torch.float32)
            steps[rotary] = cpu_layer.decode_step(
                hidden, cos.reshape(x.shape[0], -1).contiguous(), sin.reshape(x.shape[0], -1).contiguous(),
                slots, tables, seq_lens,
            )  # fmt: skip
        x = x.to(torch.float32).clone()  # written in place, layer by layer
        residual = torch.empty_like(x)
        for i, (module, layer) in enumerate(zip(self.model.layers, layers, strict=True)):
            self.kernel(layer, steps[module.self_attn.rotary_emb], x, residual, is_first=i == 0)
        return x, residual

    def _decode_layers(self, kv_caches: list) -> list[cpu_layer.DecodeLayer] | None:
        """Each layer marshalled over these caches (again when the caches change); None when
        the backend would not decode over them with its compiled kernel."""
        key = tuple((k.data_ptr(), tuple(k.shape), v.data_ptr()) for k, v in kv_caches)
        if key != self._caches_key:
            layers = self.model.layers
            if len(kv_caches) != len(layers) or not all(
                layer.self_attn.attn.backend.decodes_with_cpu_kernel(k) and k.is_contiguous() and v.is_contiguous()
                for layer, (k, v) in zip(layers, kv_caches)
            ):
                self._layers = None
            else:
                self._layers = [_decode_layer(layer, cache) for layer, cache in zip(layers, kv_caches)]
            self._caches_key = key
        return self._layers


def _projections(layer: nn.Module) -> dict[str, nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj, "gate_up_proj": mlp.gate_up_proj, "down_proj": mlp.down_proj}


def _decode_layer(layer: nn.Module, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> cpu_layer.DecodeLayer:
    attn = layer.self_attn
    weights = {name: (lin.packed_weight, lin.bias) for name, lin in _projections(layer).items()}
    return cpu_layer.decode_layer(
        input_norm=layer.input_layernorm.weight.data, post_norm=layer.post_attention_layernorm.weight.data,
        eps=layer.input_layernorm.eps, qkv=weights["qkv_proj"], o=weights["o_proj"],
        gate_up=weights["gate_up_proj"], down=weights["down_proj"], num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, scale=attn.attn.scale,
        sliding_window=attn.attn.sliding_window, soft_cap=attn.attn.soft_cap,
        key_cache=kv_cache[0], value_cache=kv_cache[1],
    )  # fmt: skip


def _is_group_quantized_cpu(model: nn.Module) -> bool:
    """A model the compiled layer is for (the only ones whose log line says why not)."""
    layer = model.layers[0]
    lin = getattr(getattr(layer, "self_attn", None), "qkv_proj", None)
    return getattr(lin, "packed_weight", None) is not None


def _why_not(model: nn.Module, skeleton: tuple[type, type, type]) -> str | None:
    cfg = model.config
    if cfg.hidden_act != "silu" or cfg.qk_norm or cfg.norm_weight_offset:
        return "the layers use another activation, q/k norms or offset norm weights"
    for layer in model.layers:
        if (type(layer), type(layer.self_attn), type(layer.mlp)) != skeleton:
            return "the family's layers differ from the skeleton's"
        if layer.self_attn.qkv_proj.parallel.tp_size != 1:
            return "tensor parallel"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu" for norm in norms):
            return "not float32 on the CPU"
        if norms[0].eps != norms[1].eps:
            return "the two norms of a layer have different epsilons"
        for lin in _projections(layer).values():
            plan = getattr(lin, "kernel_plan", None)
            if plan is None or not plan.is_compiled or getattr(lin, "packed_weight", None) is None:
                return "a projection is not held by the compiled group-quantized kernel"
            if lin.bias is not None and lin.bias.dtype != torch.float32:
                return "not float32 on the CPU"
        if not hasattr(layer.self_attn.attn.backend, "decodes_with_cpu_kernel"):
            return f"the {getattr(layer.self_attn.attn.backend, 'name', '?')} attention backend"
    return None
