"""Build a model from a local HF checkpoint directory or a GGUF file and load this rank's
weight shards.

    config.json | GGUF metadata ──> model class (by `architectures`, else `model_type`) ──> empty model
       └──> weight formats (GGUF tensor types, HF `quantization_config`) ──> layer.set_method
    *.safetensors | *.bin | GGUF tensors (kept quantized or dequantized, see gguf.py / hf_quant.py)
        ──> (hf name, full tensor) ──> model.map_weight_name ──> (our parameter, shard id) ──>
        owning layer's load_weight(param, full tensor[, shard])
    ──> every layer's process_weights_after_loading (quantized weights are repacked here, once)

Every parameter (and every shard of a fused one) must be loaded exactly from the checkpoint;
anything missing or of the wrong shape is an error that names the tensor.

`quantization`: "auto" keeps what the checkpoint quantized in a format with a kernel (GGUF
Q4_0 / Q4_1 / Q8_0, AWQ / GPTQ int4, FP8 e4m3 with per-tensor or per-channel scales); "none"
dequantizes every weight into the model dtype at load (the float path, kept for parity
tests); "gguf" / "awq" / "gptq" / "fp8" are "auto" that also checks the checkpoint is of that kind. A fused layer (q|k|v, gate|up) is kept quantized only
when all its pieces share one format; otherwise its pieces are dequantized.
"""

from __future__ import annotations

import ctypes
import json
import logging
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .gguf import find_gguf_file, gguf_hf_config, iter_gguf_weights, load_gguf_tokenizer, read_gguf_header
from .gguf import weight_formats as gguf_weight_formats
from .hf_quant import hf_weight_formats, iter_hf_quantized, quantization_method, with_quantize_config
from .layers import LinearBase, ParallelLMHead, ParallelState, copy_weight, dynamic_inv_freq_table, dynamic_max_len
from .quant import Fp8Format, GroupQuantFormat
from .registry import ARCHITECTURES

logger = logging.getLogger(__name__)

# architectures[0] in config.json -> (our model class, its config parser); from registry.py
MODEL_REGISTRY: dict[str, tuple[type[nn.Module], Any]] = {
    a.hf_name: (a.model_class, a.model_class.config_from_hf) for a in ARCHITECTURES
}
_MODEL_TYPES = {a.model_type: a.hf_name for a in ARCHITECTURES}

QUANTIZATION_CHOICES = ("auto", "none", "gguf", "awq", "gptq", "fp8")

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model: missing tensors or wrong shapes."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the engine needs to know about a model before loading it (KV sizing, stops)."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int  # total, over all ranks
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_model_len: int  # max_position_embeddings (dynamic NTK RoPE: x its factor)
    eos_token_ids: tuple[int, ...]  # config.json and generation_config.json, merged
    bos_token_id: int | None
    pad_token_id: int | None
    dtype: str  # checkpoint dtype: "float32" | "float16" | "bfloat16"
    # every layer's sliding window when all layers have the same one, else None: the block
    # manager then returns blocks wholly before the window to the pool
    sliding_window: int | None = None
    # a token's RoPE depends on its request's prompt length (dynamic NTK, LongRoPE): the
    # runner passes per-token RoPE lengths, and KV blocks are not shared across requests
    is_rope_length_dependent: bool = False
    # a sequence whose prompt is shorter is recomputed whole on reaching this length (Phi-3 LongRoPE)
    rope_recompute_len: int | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads each TP rank caches (KV heads are replicated when tp_size > num_kv_heads)."""
        return max(1, self.num_kv_heads // tp_size)


# --------------------------------------------------------------------------- configs


def require_model_dir(model_path: str | Path) -> Path:
    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {str(model_path)!r} does not exist (for 'smollm2', 'tiny-opt', 'tiny-llama' or a hub id, "
            "call rayserve_paged.models.tiny.resolve_model first)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    return path


def read_hf_config(model_path: str | Path) -> dict:
    path = require_model_dir(model_path)
    return json.loads((path / "config.json").read_text(encoding="utf-8"))


def architecture_of(hf_config: dict) -> str:
    names = hf_config.get("architectures") or [_MODEL_TYPES.get(hf_config.get("model_type", ""), "")]
    for name in names:
        if name in MODEL_REGISTRY:
            return name
    for name in names:  # a bare decoder (an embedding checkpoint: Qwen3Model) is its causal LM's skeleton
        if is_bare_decoder(name):
            return name.removesuffix("Model") + "ForCausalLM"
    found = names if any(names) else hf_config.get("model_type")
    raise ValueError(f"unsupported model architecture {found!r}; supported: {', '.join(MODEL_REGISTRY)}")


def is_bare_decoder(architecture: str) -> bool:
    """`Qwen3Model`, `LlamaModel`, ...: the decoder without its LM head, as embedding
    checkpoints are saved (tensors without the `model.` prefix, no `lm_head`)."""
    return architecture.endswith("Model") and architecture.removesuffix("Model") + "ForCausalLM" in MODEL_REGISTRY


def resolve_dtype(dtype: torch.dtype | str | None, hf_config: dict) -> torch.dtype:
    """None or "auto" -> the checkpoint's dtype (`dtype`, or older `torch_dtype`; float32 if unset)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _eos_token_ids(path: Path, hf_config: dict) -> tuple[int, ...]:
    ids = _token_ids(hf_config.get("eos_token_id"))
    generation = path / "generation_config.json"
    if generation.is_file():
        ids += _token_ids(json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))  # ordered, without repeats


def get_model_config(model_path: str | Path) -> ModelConfig:
    """The model's shape and special ids, from config.json (+ generation_config.json) or GGUF metadata."""
    gguf_file = find_gguf_file(model_path)
    if gguf_file is not None:
        hf = gguf_hf_config(gguf_file)
        eos_token_ids = tuple(_token_ids(hf["eos_token_id"]))
    else:
        path = require_model_dir(model_path)
        hf = read_hf_config(path)
        eos_token_ids = _eos_token_ids(path, hf)
    architecture = architecture_of(hf)
    cfg = MODEL_REGISTRY[architecture][1](hf)
    return ModelConfig(
        architecture=architecture,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        max_model_len=_max_model_len(hf, cfg),
        eos_token_ids=eos_token_ids,
        bos_token_id=hf.get("bos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        dtype=str(resolve_dtype(None, hf)).removeprefix("torch."),
        sliding_window=_uniform_window(getattr(cfg, "layer_windows", ())),
        is_rope_length_dependent=getattr(cfg, "is_rope_length_dependent", False),
        rope_recompute_len=getattr(cfg, "rope_recompute_len", None),
    )


def model_skeleton(model_path: str | Path) -> nn.Module:
    """The model's modules on the meta device (no memory, no weights): its layer shapes for
    checks made before any worker loads it (LoRA adapters). One rank, no attention backend."""
    gguf_file = find_gguf_file(model_path)
    hf = gguf_hf_config(gguf_file) if gguf_file is not None else read_hf_config(require_model_dir(model_path))
    model_class = MODEL_REGISTRY[architecture_of(hf)][0]
    with torch.device("meta"):
        model = model_class(hf, None, ParallelState(), resolve_dtype(None, hf))
    dynamic_inv_freq_table.cache_clear()  # it may now hold meta tensors the real model must not get
    return model


def _max_model_len(hf: dict, cfg: Any) -> int:
    rope = getattr(cfg, "rope", None)
    if rope is not None and rope.rope_type == "dynamic":
        return dynamic_max_len(rope)
    return hf["max_position_embeddings"]


def _uniform_window(windows: tuple[int | None, ...]) -> int | None:
    return windows[0] if windows and None not in windows and len(set(windows)) == 1 else None


# --------------------------------------------------------------------------- checkpoints


def _indexed_files(path: Path, index_name: str) -> list[Path] | None:
    index = path / index_name
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    return [path / name for name in sorted(set(weight_map.values()))]


def checkpoint_files(path: Path) -> list[Path]:
    """Safetensors when there are any (by their index if present), else PyTorch .bin files."""
    files = _indexed_files(path, "model.safetensors.index.json") or sorted(path.glob("*.safetensors"))
    if not files:
        files = _indexed_files(path, "pytorch_model.bin.index.json") or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no model weights (*.safetensors or pytorch_model*.bin) in {str(path)!r}")
    return files


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, full tensor on CPU), one file at a time."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as tensors:
                for name in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, tensors.get_tensor(name)
        else:
            yield from _load_bin(file).items()


def iter_checkpoint_names(path: Path) -> Iterator[str]:
    """The tensor names of a checkpoint, without reading the tensors (safetensors headers)."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as tensors:
                yield from tensors.keys()
        else:
            yield from _load_bin(file).keys()


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:  # zip-format files (torch >= 1.6) map lazily instead of being read whole
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy tar format cannot be mmapped
        return torch.load(file, map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------- loading


def _loader_of(model: nn.Module, param_name: str):
    """(load function, expected shard ids) for a parameter: its layer's load_weight if any."""
    module_name = param_name.rpartition(".")[0]
    module = model.get_submodule(module_name)
    return getattr(module, "load_weight", None) or copy_weight, getattr(module, "shard_ids", None)


def load_weights(
    model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], source: str = "checkpoint", optional: tuple = ()
) -> None:
    """Load every parameter of `model` from (HF name, full tensor) pairs; raise on gaps or
    misfits (a parameter named in `optional` that no tensor fills is zeroed instead)."""
    params = dict(model.named_parameters())  # tied parameters appear once
    loaded: set[tuple[str, Any]] = set()
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        target = model.map_weight_name(hf_name)
        if target is None:
            continue
        name, shard_id = target
        if name not in params:
            unexpected.append(hf_name)
            continue
        load, _ = _loader_of(model, name)
        # a tuple of shard ids: one checkpoint tensor holds several shards (Phi-3's qkv_proj)
        pieces = [(shard_id, tensor)] if not isinstance(shard_id, tuple) else _fused_pieces(model, name, tensor, shard_id)
        try:
            for piece_id, piece in pieces:
                if piece_id is None:
                    load(params[name], piece)
                else:
                    load(params[name], piece, piece_id)
        except ValueError as exc:
            raise WeightLoadError(
                f"{source}: tensor {hf_name!r} of shape {list(tensor.shape)} does not fit parameter {name!r}: {exc}"
            ) from exc
        loaded.update((name, piece_id) for piece_id, _ in pieces)
    if unexpected:
        logger.warning("%s: ignored %d unexpected tensors, e.g. %s", source, len(unexpected), unexpected[:5])
    for name in optional:
        if name in params and not any(key[0] == name for key in loaded):
            params[name].zero_()
            loaded.update((name, shard_id) for shard_id in (_loader_of(model, name)[1] or (None,)))
    _check_all_loaded(model, params, loaded, source)


def _fused_pieces(model: nn.Module, name: str, tensor: torch.Tensor, shard_ids: tuple) -> list:
    module = model.get_submodule(name.rpartition(".")[0])
    parts = module.split_fused(tensor)
    if len(parts) != len(shard_ids) or sum(p.shape[0] for p in parts) != tensor.shape[0]:
        raise WeightLoadError(f"fused tensor for {name!r} of shape {list(tensor.shape)} does not split into {shard_ids}")
    return list(zip(shard_ids, parts))


def _check_all_loaded(model: nn.Module, params: dict, loaded: set[tuple[str, Any]], source: str) -> None:
    missing = []
    for name in params:
        _, shard_ids = _loader_of(model, name)
        for shard_id in shard_ids or (None,):
            if (name, shard_id) not in loaded:
                missing.append(name if shard_id is None else f"{name} (shard {shard_id!r})")
    if missing:
        shown = ", ".join(missing[:10]) + (f" ... and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise WeightLoadError(f"{source}: missing weights for {len(missing)} parameters: {shown}")


def load_model(
    model_path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    attn_backend: Any = "torch",
    tp_rank: int = 0,
    tp_size: int = 1,
    group: Any = None,
    parallel: ParallelState | None = None,
    quantization: str = "auto",
) -> nn.Module:
    """The model for a local HF checkpoint dir or GGUF file, with this rank's shards, in eval mode.

    dtype: torch dtype, a name, or None / "auto" for the checkpoint's. attn_backend: a backend
    object or a name for `ops.backends.get_attention_backend`. With tp_size > 1,
    torch.distributed must be initialized; `group` defaults to the default process group.
    `parallel`, when given, replaces (tp_rank, tp_size, group) with a ready ParallelState.
    quantization: one of QUANTIZATION_CHOICES (module docstring).
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"unsupported quantization {quantization!r}; supported: {', '.join(QUANTIZATION_CHOICES)}")
    start = time.perf_counter()
    gguf_file = find_gguf_file(model_path)
    if gguf_file is not None:
        hf, source = gguf_hf_config(gguf_file), gguf_file
        kind, formats = "gguf", gguf_weight_formats(read_gguf_header(gguf_file))
    else:
        source = require_model_dir(model_path)
        hf = with_quantize_config(read_hf_config(source), source)
        kind = quantization_method(hf)
        formats = hf_weight_formats(hf, iter_checkpoint_names(source)) if kind else {}
    if quantization not in ("auto", "none") and quantization != kind:
        raise ValueError(f"quantization {quantization!r} was asked for, but {source} is {kind or 'not quantized'}")
    model_class = MODEL_REGISTRY[architecture_of(hf)][0]
    dtype = resolve_dtype(dtype, hf)
    device = torch.device(device)
    if isinstance(attn_backend, str):
        from rayserve_paged.ops.backends import get_attention_backend

        attn_backend = get_attention_backend(attn_backend, device)
    parallel = parallel or ParallelState(tp_rank, tp_size, group)
    with torch.device(device):
        model = model_class(hf, attn_backend, parallel, dtype)
    kept = apply_weight_formats(model, formats if quantization != "none" else {})
    if gguf_file is not None:
        weights = iter_gguf_weights(gguf_file, hf, kept)
    else:
        weights = iter_checkpoint(source)
        if kind:
            weights = iter_hf_quantized(weights, hf, kept)
    names = hf.get("architectures") or []
    is_bare = gguf_file is None and architecture_of(hf) not in names and any(map(is_bare_decoder, names))
    if is_bare:  # the checkpoint's names are the decoder's own; its (unused) LM head stays zero
        weights = (("model." + name, tensor) for name, tensor in weights)
    with torch.no_grad():
        load_weights(model, weights, source=str(source), optional=("lm_head.weight",) if is_bare else ())
        process_weights_after_loading(model)
    if device.type == "cpu":
        release_freed_memory()
    _log_load(source, dtype, device, time.perf_counter() - start, _describe_formats(formats, kept))
    return model.eval()


def apply_weight_formats(model: nn.Module, formats: dict[str, GroupQuantFormat | Fp8Format]) -> frozenset[str]:
    """Give every layer whose checkpoint weights (all pieces of a fused one) share one format
    that format's method; returns the HF weight names now loaded quantized."""
    by_module: dict[str, dict[Any, tuple[str, GroupQuantFormat | Fp8Format | None]]] = {}
    for hf_name, fmt in formats.items():
        target = model.map_weight_name(hf_name)
        if target is not None:
            module_name = target[0].rpartition(".")[0]
            by_module.setdefault(module_name, {})[target[1]] = (hf_name, fmt)
    kept = set()
    for module_name, pieces in by_module.items():
        module = model.get_submodule(module_name)
        if not isinstance(module, LinearBase) or (isinstance(module, ParallelLMHead) and module.tied_to):
            continue
        shards = module.shard_ids or (None,)
        fmts = {fmt for _, fmt in pieces.values()}
        if set(pieces) != set(shards) or len(fmts) != 1:
            continue  # some pieces float or of different formats: dequantize them all
        module.set_method(fmts.pop().make_method())
        kept.update(hf_name for hf_name, _ in pieces.values())
    return frozenset(kept)


def process_weights_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.process_weights_after_loading()


def _describe_formats(formats: dict[str, GroupQuantFormat | Fp8Format], kept: frozenset[str]) -> str:
    if not formats:
        return "float weights"
    kept_names = sorted({fmt.name for name, fmt in formats.items() if name in kept})
    dequantized_names = sorted({fmt.name for name, fmt in formats.items() if name not in kept})
    return (
        f"{len(kept)} weights kept quantized ({', '.join(kept_names) or 'none'}), {len(formats) - len(kept)} "
        f"quantized weights dequantized ({', '.join(dequantized_names) or 'none'})"
    )


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): loading frees the
    checkpoint-form tensors of every repacked layer, which glibc otherwise keeps resident."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: Linux's VmHWM (the high-water mark of this
    address space; ru_maxrss also counts the parent's memory a process was forked from before
    its exec), else ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _log_load(source: Path, dtype: torch.dtype, device: torch.device, seconds: float, formats: str) -> None:
    peak = f"peak RSS {peak_rss_bytes() / 2**30:.2f} GiB"
    if device.type == "cuda":
        peak += f", peak CUDA allocated {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    logger.info("loaded %s as %s on %s in %.1f s (%s; %s)", source, dtype, device, seconds, formats, peak)


def load_tokenizer(model: str | Path, trust_remote_code: bool = False):
    """The tokenizer of a model name ("smollm2", "tiny-opt", ...), local directory, GGUF file
    (converted from its metadata, chat template included) or hub id (tokenizer files only)."""
    from transformers import AutoTokenizer

    from .tiny import BUILTIN_MODELS, resolve_model

    name = str(model)
    path = resolve_model(name) if name in BUILTIN_MODELS else Path(name).expanduser()
    gguf_file = find_gguf_file(path) if path.exists() or path.suffix == ".gguf" else None
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file)
    return AutoTokenizer.from_pretrained(str(path) if path.exists() else name, trust_remote_code=trust_remote_code)
