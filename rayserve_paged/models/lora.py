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

import hashlib
import json
import math
import re
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
    """An adapter this model cannot run; the message says why, naming the file or field and
    never quoting the files' contents (the HTTP error prefixes `lora_path:`)."""


MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: PEFT writes ~1 KB
MAX_CONFIG_DEPTH = 16  # nesting of adapter_config.json (PEFT's is 2 deep)


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    """An adapter as its directory holds it (full, unsharded tensors on the CPU)."""

    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) (rsLoRA)
    target_modules: tuple[str, ...] | str
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # checkpoint module -> (A [r, in], B [out, r])
    digest: str = ""  # blake2b of adapter_model.safetensors, hex
    num_bytes: int = 0  # of the float32 tensors held (what the CPU memory bound counts)


def read_peft_adapter(
    path: str | Path, max_lora_rank: int, known_targets: set[str] | None = None, max_bytes: int | None = None
) -> PeftAdapter:
    """Read and check a PEFT LoRA directory, each file once (its target_modules among
    `known_targets`, when given; its weights file at most `max_bytes`); raises LoRAError
    naming what is wrong."""
    where = Path(path)
    config_file, weights_file = where / CONFIG_FILE, where / WEIGHTS_FILE
    try:
        if not config_file.is_file():
            raise LoRAError(f"no {CONFIG_FILE} in the directory (is it a PEFT LoRA directory?)")
        if not weights_file.is_file():
            raise LoRAError(f"no {WEIGHTS_FILE} in the directory")
        if config_file.stat().st_size > MAX_CONFIG_BYTES:
            raise LoRAError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
        config_bytes = config_file.read_bytes()
        size = weights_file.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise LoRAError(f"{WEIGHTS_FILE} is {size / 2**20:.1f} MiB, above max_lora_size_mb ({max_bytes / 2**20:g})")
        config = _parse_config(config_bytes)
        rank, alpha = _config_number(config, "r"), _config_number(config, "lora_alpha")
        _check_supported(config, path)
        if rank > max_lora_rank:
            raise LoRAError(f"rank r={rank} exceeds max_lora_rank {max_lora_rank}")
        targets = config.get("target_modules")
        is_names = isinstance(targets, list) and all(isinstance(t, str) for t in targets)
        if not targets or not (isinstance(targets, str) or is_names):
            raise LoRAError(f"{CONFIG_FILE} target_modules must be a list of module names or a pattern")
        if known_targets is not None and isinstance(targets, list):
            _check_targets(path, targets, known_targets)
        data = weights_file.read_bytes()
    except OSError as exc:  # unreadable, a name too long, a directory that vanished
        raise LoRAError(f"the adapter directory cannot be read ({exc.strerror or type(exc).__name__})") from None
    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    tensors = _lora_tensors(data, rank)
    del data
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    names = tuple(targets) if isinstance(targets, list) else targets
    num_bytes = sum(a.nbytes + b.nbytes for a, b in tensors.values())
    return PeftAdapter(str(path), rank, scaling, names, tensors, digest, num_bytes)


def _parse_config(raw: bytes) -> dict:
    def refuse(constant: str):
        raise ValueError("not a number")

    try:
        config = json.loads(raw.decode("utf-8"), parse_constant=refuse)
    except RecursionError:
        raise LoRAError(f"{CONFIG_FILE} is nested too deeply") from None
    except ValueError:  # also UnicodeDecodeError; NaN / Infinity refused by parse_constant
        raise LoRAError(f"{CONFIG_FILE} is not valid JSON (NaN and Infinity are not numbers)") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{CONFIG_FILE} must hold a JSON object")
    if _depth(config) > MAX_CONFIG_DEPTH:
        raise LoRAError(f"{CONFIG_FILE} is nested too deeply (more than {MAX_CONFIG_DEPTH} levels)")
    return config


def _depth(value) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_CONFIG_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _lora_tensors(data: bytes, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """checkpoint module -> (A [r, in], B [out, r]) float32, every value finite."""
    from safetensors.torch import load

    try:
        raw = load(data)
    except Exception:  # safetensors raises its own error types for a damaged file
        raise LoRAError(f"{WEIGHTS_FILE} cannot be read as safetensors") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in raw.items():
        match = _TENSOR.match(name.removeprefix(_PEFT_PREFIX))
        if match is None:
            raise LoRAError(f"tensor {_shown(name)} is not a LoRA A or B weight (only LoRA is supported)")
        if not tensor.is_floating_point():
            raise LoRAError(f"tensor {_shown(name)} is not floating point")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    tensors = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"module {_shown(module)} has lora_{'A' if 'A' in pair else 'B'} only")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(
                f"module {_shown(module)}: shape mismatch, lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)} for rank {rank}"
            )
        a, b = a.to(torch.float32), b.to(torch.float32)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"module {_shown(module)}: NaN or infinite weights")
        tensors[module] = (a, b)
    if not tensors:
        raise LoRAError(f"{WEIGHTS_FILE} holds no LoRA weights")
    return tensors


def _shown(name: str) -> str:
    """A module or tensor name as an error quotes it (bounded)."""
    return repr(name if len(name) <= 80 else name[:77] + "...")


def _config_number(config: dict, key: str) -> int | float:
    value = config.get(key)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value <= 0 or (key == "r" and value != int(value)):
        raise LoRAError(f"{CONFIG_FILE} {key} must be a positive {'integer' if key == 'r' else 'finite number'}")
    return int(value) if key == "r" else float(value)


def _check_supported(config: dict, path) -> None:
    """What PEFT can write that these layers do not run, each refused by name."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{CONFIG_FILE} peft_type is not supported (LORA only)")
    for key, why in (
        ("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)"),
        ("modules_to_save", "modules_to_save (fully trained modules)"), ("rank_pattern", "rank_pattern"),
        ("alpha_pattern", "alpha_pattern"), ("layer_replication", "layer_replication"),
    ):  # fmt: skip
        if config.get(key):
            raise LoRAError(f"{CONFIG_FILE}: {why} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{CONFIG_FILE} bias is not supported (bias 'none' only)")


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
        f"target module {_shown(module)} is unknown to this model (supported: {', '.join(sorted(known))})"
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
    for module, (a, b) in sorted(adapter.tensors.items()):  # the first wrong module, named, is always the same one
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
            raise LoRAError(f"module {_shown(module)}: shape mismatch: {exc}") from exc
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


def check_adapter(model: nn.Module, path: str | Path, max_lora_rank: int, max_bytes: int | None = None) -> PeftAdapter:
    """Read the adapter and fit it to the model (a skeleton will do); raises LoRAError."""
    adapter = read_peft_adapter(path, max_lora_rank, target_names(model), max_bytes)
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
    num_added: int = 0  # adapters given to this rank (at registration)
    num_activations: int = 0  # adapters put into a slot (from CPU memory)


class LoRAPool:
    """One rank's adapter slots: `max_loras` slots in every LoRA layer of the model, filled
    from CPU memory, where each registered adapter's tensors (already cut to this rank) stay
    from registration (`add`, off the step) until the engine retires it (`remove`). A step
    only copies tensors from CPU memory into slots: it never reads a file."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
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
        self.slot_of: dict[tuple, int] = {}  # adapter key (core/lora.LoRAKey) -> its slot
        self._in_slot: list[tuple | None] = [None] * max_loras
        self._cpu: dict[tuple, dict] = {}  # adapter key -> this rank's shards (layer -> (a, b))
        self.counters = LoRAPoolCounters()

    def add(self, key: tuple, adapter: PeftAdapter) -> None:
        """Keep the adapter's tensors, cut to this rank, for later activations (thread-safe:
        called off the step thread; the key is new, so no step reads it yet)."""
        shards = shard_adapter(self.model, adapter, self.max_lora_rank)
        self._cpu[key] = shards
        self.counters.num_added += 1

    def remove(self, key: tuple) -> None:
        """The adapter is retired: its tensors go, and its slot (idle by then) is emptied."""
        self._cpu.pop(key, None)
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self._in_slot[slot] = None

    def holds(self, key: tuple) -> bool:
        return key in self._cpu

    def activate(self, slot: int, key: tuple) -> None:
        """Put the adapter into the slot (its previous adapter leaves it); LoRAError when
        its tensors are not in CPU memory (the slot is then empty)."""
        previous = self._in_slot[slot]
        if previous is not None:
            self.slot_of.pop(previous, None)
            self._in_slot[slot] = None
        shards = self._cpu.get(key)
        if shards is None:
            raise LoRAError(f"adapter {key[0]} is not in this rank's CPU memory")
        for name, layer in self.layers.items():
            pair = shards.get(name)
            if pair is None:
                layer.lora_a[slot].zero_()
                layer.lora_b[slot].zero_()
            else:
                layer.lora_a[slot].copy_(pair[0])
                layer.lora_b[slot].copy_(pair[1])
        self._in_slot[slot] = key
        self.slot_of[key] = slot
        self.counters.num_activations += 1
