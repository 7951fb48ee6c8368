"""LoRA adapters in PEFT's format on the models' parallel linear layers, many per batch.

    adapter dir: adapter_config.json (r, lora_alpha, target_modules, ...)
                 adapter_model.safetensors  base_model.model.<module>.lora_A.weight [r, in]
                                            base_model.model.<module>.lora_B.weight [out, r]

An adapter's module names are the checkpoint's (q_proj, k_proj, ...): the model's own weight
mapper (`map_weight_name`) takes each to our layer and shard, as it does the base weights.

Every LoRA-capable layer (a column- or row-parallel linear) holds one pool of `max_loras`
slots (ops/lora.py draws the layout); a fused layer (q|k|v, gate|up) gives each piece its own
block of `max_lora_rank` rank columns, B block-diagonal:

    a [slots, pieces * R, in per rank]      [ A_q ; A_k ; A_v ]  (each R rows, zero past r)
    b [slots, out per rank, pieces * R]     [ B_q 0 0 ; 0 B_k 0 ; 0 0 B_v ]

Sharded like the layer: a column-parallel layer keeps B's rows of this rank (the pieces cut
by the layer's own load_weight, so KV-head replication is the base weight's) and all of A;
a row-parallel layer keeps A's columns of this rank and all of B, its partial products summed
by the layer's one all-reduce. lora_alpha / r (or / sqrt(r) with rsLoRA) is folded into B.

The runner sets the step's token -> slot map once (`LoRABatch.set_step`); each layer adds
its contribution after its base matmul (LinearBase.matmul), without merging anything.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rayserve_paged.ops.lora import Segments, add_lora_segments, lora_segments

from .layers import ColumnParallelLinear, LinearBase, RowParallelLinear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter this model cannot run; the message says why (and names the adapter)."""


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    """An adapter as its directory holds it (full, unsharded tensors on the CPU)."""

    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) (rsLoRA)
    target_modules: tuple[str, ...] | str
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # checkpoint module -> (A [r, in], B [out, r])


def read_peft_adapter(path: str | Path, max_lora_rank: int, known_targets: set[str] | None = None) -> PeftAdapter:
    """Read and check a PEFT LoRA directory (its target_modules among `known_targets`, when
    given); raises LoRAError naming what is wrong."""
    from safetensors.torch import load_file

    where = Path(path)
    config_file, weights_file = where / CONFIG_FILE, where / WEIGHTS_FILE
    if not config_file.is_file():
        raise LoRAError(f"adapter {path}: no {CONFIG_FILE} (is it a PEFT LoRA directory?)")
    if not weights_file.is_file():
        raise LoRAError(f"adapter {path}: no {WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoRAError(f"adapter {path}: {CONFIG_FILE} is not JSON: {exc}") from exc
    rank, alpha = _config_number(config, "r", path), _config_number(config, "lora_alpha", path)
    _check_supported(config, path)
    if rank > max_lora_rank:
        raise LoRAError(f"adapter {path}: rank r={rank} exceeds max_lora_rank {max_lora_rank}")
    targets = config.get("target_modules")
    if not targets or not isinstance(targets, (str, list)):
        raise LoRAError(f"adapter {path}: target_modules must be a list of module names or a pattern")
    if known_targets is not None and isinstance(targets, list):
        _check_targets(path, targets, known_targets)
    try:
        raw = load_file(str(weights_file))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise LoRAError(f"adapter {path}: {WEIGHTS_FILE} cannot be read: {exc}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in raw.items():
        match = _TENSOR.match(name.removeprefix(_PEFT_PREFIX))
        if match is None:
            raise LoRAError(f"adapter {path}: tensor {name!r} is not a LoRA A or B weight (only LoRA is supported)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    tensors = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"adapter {path}: module {module!r} has lora_{'A' if 'A' in pair else 'B'} only")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(
                f"adapter {path}: module {module!r}: shape mismatch, lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)} for rank {rank}"
            )
        tensors[module] = (a.to(torch.float32), b.to(torch.float32))
    if not tensors:
        raise LoRAError(f"adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    names = tuple(targets) if isinstance(targets, list) else targets
    return PeftAdapter(str(path), rank, scaling, names, tensors)


def _config_number(config: dict, key: str, path) -> int | float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (key == "r" and value != int(value)):
        raise LoRAError(f"adapter {path}: {CONFIG_FILE} {key} must be a positive {'integer' if key == 'r' else 'number'}")
    return int(value) if key == "r" else float(value)


def _check_supported(config: dict, path) -> None:
    """What PEFT can write that these layers do not run, each refused by name."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"adapter {path}: peft_type {peft_type!r} is not supported (LORA only)")
    for key, why in (
        ("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)"),
        ("modules_to_save", "modules_to_save (fully trained modules)"), ("rank_pattern", "rank_pattern"),
        ("alpha_pattern", "alpha_pattern"), ("layer_replication", "layer_replication"),
    ):  # fmt: skip
        if config.get(key):
            raise LoRAError(f"adapter {path}: {why} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapter {path}: bias {config['bias']!r} is not supported (bias 'none' only)")


# --------------------------------------------------------------------------- the model's layers


def lora_layers(model: nn.Module) -> dict[str, LinearBase]:
    """Our name -> layer, for every layer an adapter may modify."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not getattr(module, "gather_output", False)
    }


def target_names(model: nn.Module) -> set[str]:
    """Checkpoint module names (the last part: q_proj, fc1, ...) an adapter may target."""
    packed = getattr(model, "packed_modules", {})
    fused = {target for target, _ in packed.values()}
    names = {name.rpartition(".")[2] for name in lora_layers(model)}
    return {n for n in names if n not in fused or n in packed} | {hf for hf, (t, _) in packed.items() if t in names}


def _check_targets(path, targets, known: set[str]) -> None:
    unknown = sorted(set(targets) - known)
    if unknown:
        raise _unknown_target(path, unknown[0], known)


def _unknown_target(path, module: str, known: set[str]) -> LoRAError:
    return LoRAError(
        f"adapter {path}: target module {module!r} is unknown to this model (supported: {', '.join(sorted(known))})"
    )


def _num_pieces(layer: LinearBase) -> int:
    return len(layer.shard_ids) if layer.shard_ids is not None else 1


def shard_adapter(
    model: nn.Module, adapter: PeftAdapter, max_lora_rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's pool entries of the adapter, per targeted layer: (a [pieces * R, in per
    rank], b [out per rank, pieces * R]) on the CPU, scaling folded into b. Raises LoRAError
    for an unknown target module or a shape that does not fit the layer."""
    known = target_names(model)
    if isinstance(adapter.target_modules, tuple):
        _check_targets(adapter.path, adapter.target_modules, known)
    layers = lora_layers(model)
    rank, width = adapter.rank, max_lora_rank
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a, b) in adapter.tensors.items():
        target = model.map_weight_name(module + ".weight")
        layer_name = target[0].rpartition(".")[0] if target is not None else None
        layer = layers.get(layer_name)
        if layer is None:
            raise _unknown_target(adapter.path, module, known)
        shard_id = target[1]
        out_rows, in_cols = layer.weight_shape  # this rank's
        if layer_name not in out:
            pieces = _num_pieces(layer)
            out[layer_name] = (torch.zeros(pieces * width, in_cols), torch.zeros(out_rows, pieces * width))
        pool_a, pool_b = out[layer_name]
        block = layer.shard_ids.index(shard_id) if layer.shard_ids is not None and not isinstance(shard_id, tuple) else 0
        try:
            a_rank, b_rank = _shard_pair(layer, a, b, shard_id)
        except ValueError as exc:
            raise LoRAError(f"adapter {adapter.path}: module {module!r}: shape mismatch: {exc}") from exc
        pool_a[block * width : block * width + rank] = a_rank
        pool_b[:, block * width : block * width + rank] += b_rank * adapter.scaling
    return out


def _shard_pair(layer: LinearBase, a: torch.Tensor, b: torch.Tensor, shard_id) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one module cut to this rank: A [r, in per rank], B [out per rank, r] (placed
    in the piece's rows of a fused layer, zero elsewhere)."""
    rank = a.shape[0]
    if a.shape[1] != layer.input_size:
        raise ValueError(f"lora_A {list(a.shape)} for a layer of {layer.input_size} input features")
    if isinstance(layer, RowParallelLinear):
        if tuple(b.shape) != (layer.output_size, rank):
            raise ValueError(f"lora_B {list(b.shape)} for a layer of {layer.output_size} output features")
        cols = layer.input_size_per_rank
        return a.narrow(1, layer.parallel.tp_rank * cols, cols), b
    b_rank = torch.zeros(layer.weight_shape[0], rank, device=b.device)
    if shard_id is None:
        layer.load_weight(b_rank, b)
    elif isinstance(shard_id, tuple):  # one checkpoint module holds every piece (Phi-3's qkv_proj)
        for piece_id, piece in zip(shard_id, layer.split_fused(b)):
            layer.load_weight(b_rank, piece, piece_id)
    else:
        layer.load_weight(b_rank, b, shard_id)
    return a, b_rank


def check_adapter(model: nn.Module, path: str | Path, max_lora_rank: int) -> PeftAdapter:
    """Read the adapter and fit it to the model (a skeleton will do); raises LoRAError."""
    adapter = read_peft_adapter(path, max_lora_rank, target_names(model))
    shard_adapter(model, adapter, max_lora_rank)
    return adapter


# --------------------------------------------------------------------------- the slot pool


class LoRABatch:
    """The step's token -> adapter slot map, shared by every LoRA layer of one model: on
    CUDA the slots [T] for the Triton kernels (ops/triton_lora.py), on the CPU the tokens
    grouped by slot (ops/lora.py), built once per step."""

    def __init__(self) -> None:
        self.is_active = False
        self.segments: Segments = []
        self.token_slots: torch.Tensor | None = None  # [T] int32, CUDA only

    def set_step(self, token_slots: list[int] | None, device: torch.device | str) -> None:
        """token_slots: per token in packing order, its row's slot (-1: base); None: all base."""
        self.clear()
        if not token_slots or max(token_slots) < 0:
            return
        self.is_active = True
        if torch.device(device).type == "cuda":
            self.token_slots = torch.tensor(token_slots, dtype=torch.int32).to(device, non_blocking=True)
        else:
            self.segments = lora_segments(token_slots, device)

    def clear(self) -> None:
        self.is_active, self.segments, self.token_slots = False, [], None

    def apply(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.token_slots is not None:
            from rayserve_paged.ops.triton_lora import lora_add

            return lora_add(y, x, a, b, self.token_slots)
        return add_lora_segments(y, x, a, b, self.segments)


@dataclass(slots=True)
class LoRAPoolCounters:
    num_disk_loads: int = 0  # adapters read from their directory
    num_cpu_hits: int = 0  # ... or found in the CPU LRU


class LoRAPool:
    """One rank's adapter slots: `max_loras` slots in every LoRA layer of the model, filled
    from an LRU of up to `max_cpu_loras` adapters kept in CPU memory (already cut to this
    rank), read from disk on a miss."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, 1)
        self.batch = LoRABatch()
        self.layers = lora_layers(model)
        for layer in self.layers.values():
            weight = next(getattr(layer, n) for n in layer.method.param_names)
            dtype = layer.params_dtype or torch.float32
            width = _num_pieces(layer) * max_lora_rank
            out_rows, in_cols = layer.weight_shape
            layer.lora_a = torch.zeros(max_loras, width, in_cols, dtype=dtype, device=weight.device)  # [L, W, in]
            layer.lora_b = torch.zeros(max_loras, out_rows, width, dtype=dtype, device=weight.device)  # [L, out, W]
            layer.lora_batch = self.batch
        self.slot_of: dict[int, int] = {}  # adapter id -> its slot
        self._in_slot: list[int | None] = [None] * max_loras
        self._cpu: OrderedDict[int, tuple[str, dict]] = OrderedDict()  # adapter id -> (path, shards)
        self.counters = LoRAPoolCounters()

    def activate(self, slot: int, lora_id: int, path: str) -> None:
        """Put the adapter into the slot (its previous adapter leaves it)."""
        shards = self._shards(lora_id, path)
        for name, layer in self.layers.items():
            pair = shards.get(name)
            if pair is None:
                layer.lora_a[slot].zero_()
                layer.lora_b[slot].zero_()
            else:
                layer.lora_a[slot].copy_(pair[0])
                layer.lora_b[slot].copy_(pair[1])
        previous = self._in_slot[slot]
        if previous is not None:
            self.slot_of.pop(previous, None)
        self._in_slot[slot] = lora_id
        self.slot_of[lora_id] = slot

    def _shards(self, lora_id: int, path: str) -> dict:
        cached = self._cpu.get(lora_id)
        if cached is not None and cached[0] == path:
            self._cpu.move_to_end(lora_id)
            self.counters.num_cpu_hits += 1
            return cached[1]
        adapter = read_peft_adapter(path, self.max_lora_rank, target_names(self.model))
        shards = shard_adapter(self.model, adapter, self.max_lora_rank)
        self.counters.num_disk_loads += 1
        self._cpu[lora_id] = (path, shards)
        self._cpu.move_to_end(lora_id)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)
        return shards
