"""GGUF checkpoints (llama.cpp's single-file format): config, weights and tokenizer.

    file.gguf ──> header: metadata key/values + tensor infos (name, ggml type, shape, offset)
       │            │
       │            ├──> HF-style config dict (`llama.*` keys) ──> the same model classes
       │            └──> tensor names  blk.N.attn_q ──> model.layers.N.self_attn.q_proj ...
       └──> tensor data (mmap) ──> Q4_0 / Q4_1 / Q8_0: codes + group scales and offsets
                                   (quant.QuantizedTensor, exact) ──> kept quantized
                                 ──> other types, or quantization "none": gguf.quants.dequantize
                                   ──> float32 ──> load_weights

The header is parsed here with `struct` over an mmap: the `gguf` package's GGUFReader builds
a numpy view per element of every metadata array, which for a 49k-token vocabulary costs
seconds per process (measured in docs/BENCHMARKS.md), and every process that loads a model
or only sizes its KV cache reads the header. Dequantization is the `gguf` package's.

llama.cpp's converter permutes the rows of Llama's q and k projections (its RoPE pairs
adjacent dimensions, HF's pairs the two halves); `_unpermute` undoes it, as transformers'
GGUF loader does.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .quant import GroupQuantFormat, QuantizedTensor
from .registry import BY_GGUF_NAME

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml type names this loader dequantizes (the `gguf` package's GGMLQuantizationType names)
SUPPORTED_GGML_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

# ggml types kept quantized (quant.GroupQuantLinearMethod): name -> bits; the others dequantize
KEPT_QUANTIZED_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
GGML_BLOCK_SIZE = 32  # elements per block of Q4_0 / Q4_1 / Q8_0: one scale (and min) each

# general.architecture -> HF architecture the project runs (registry.py)
GGUF_ARCHITECTURES = {name: a.hf_name for name, a in BY_GGUF_NAME.items()}

# metadata value types: id -> struct format (8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file this loader cannot use; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # torch order (GGUF stores dims fastest-first; reversed here)
    offset: int  # absolute, in the file
    num_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


# --------------------------------------------------------------------------- files


def find_gguf_file(model_path: str | Path) -> Path | None:
    """The GGUF file `model_path` names: a .gguf file, or the one .gguf in a directory without
    config.json; None for anything else (an HF checkpoint directory)."""
    path = Path(model_path).expanduser()
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(model_path)!r} does not exist")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise FileNotFoundError(f"{str(path)!r} holds several GGUF files ({names}); name one as the model")
    return found[0] if found else None


class _Cursor:
    """Little-endian reads over a buffer; running past its end is a truncated file."""

    def __init__(self, buf, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header (ends at byte {len(self.buf)})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.pos + length > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header (ends at byte {len(self.buf)})")
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, type_id: int) -> Any:
        if type_id in _SCALARS:
            return self.unpack(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALARS and item_type != 7:  # numbers: one numpy read
                dtype = np.dtype(_SCALARS[item_type])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFError(f"{self.path}: truncated GGUF header (ends at byte {len(self.buf)})")
                items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return items
            return [self.value(item_type) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF metadata value type {type_id} at byte {self.pos}")


def _tensor_num_bytes(path: Path, name: str, ggml_type: int, shape: tuple[int, ...]) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise GGUFError(f"{path}: tensor {name!r} has unknown ggml type id {ggml_type}") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_elements = int(np.prod(shape)) if shape else 1
    return num_elements // block_size * type_size


@functools.lru_cache(maxsize=4)
def _read_header_cached(path: Path, size: int, mtime_ns: int) -> GGUFHeader:
    with open(path, "rb") as f:
        if size == 0:
            raise GGUFError(f"{path}: empty file, not a GGUF checkpoint")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(path, buf)


def _parse_header(path: Path, buf) -> GGUFHeader:
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    num_tensors, num_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        num_dims = cur.unpack("<I")
        dims = tuple(cur.unpack("<Q") for _ in range(num_dims))
        infos.append((name, cur.unpack("<I"), tuple(reversed(dims)), cur.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, ggml_type, shape, offset in infos:
        num_bytes = _tensor_num_bytes(path, name, ggml_type, shape)
        tensor = GGUFTensor(name, ggml_type, shape, data_start + offset, num_bytes)
        if tensor.offset + num_bytes > len(buf):
            raise GGUFError(
                f"{path}: truncated GGUF file: tensor {name!r} needs bytes up to {tensor.offset + num_bytes}, "
                f"the file has {len(buf)}"
            )
        tensors[name] = tensor
    return GGUFHeader(path, metadata, tensors)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor infos of a GGUF file (cached per file version in this process)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _read_header_cached(path, stat.st_size, stat.st_mtime_ns)


# --------------------------------------------------------------------------- config


def _require(header: GGUFHeader, key: str) -> Any:
    if key not in header.metadata:
        raise GGUFError(f"{header.path}: GGUF metadata lacks {key!r}")
    return header.metadata[key]


def _ggml_type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name


def check_supported(header: GGUFHeader) -> str:
    """The HF architecture of a GGUF file whose architecture and tensor types this loader runs."""
    arch = header.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{header.path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    for tensor in header.tensors.values():
        type_name = _ggml_type_name(tensor.ggml_type)
        if type_name not in SUPPORTED_GGML_TYPES:
            raise GGUFError(
                f"{header.path}: tensor {tensor.name!r} uses GGUF quantization type {type_name}, which is not "
                f"supported; supported: {', '.join(SUPPORTED_GGML_TYPES)}"
            )
    return GGUF_ARCHITECTURES[arch]


def _rope_parameters(header: GGUFHeader, arch: str) -> dict:
    meta = header.metadata
    params = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        params |= {"rope_type": "linear", "factor": float(_require(header, f"{arch}.rope.scaling.factor"))}
    elif scaling != "none":
        raise GGUFError(f"{header.path}: unsupported GGUF RoPE scaling {scaling!r}; supported: none, linear")
    factors = header.tensors.get("rope_freqs.weight")  # Llama 3.1+: llama3 scaling, per dimension
    if factors is not None:
        params["freq_factors"] = _vector(header, factors)
    if "rope_factors_long.weight" in header.tensors:  # Phi-3 LongRoPE, as llama.cpp's converter writes it
        params |= {
            "rope_type": "longrope",
            "long_factor": _vector(header, header.tensors["rope_factors_long.weight"]),
            "short_factor": _vector(header, _require_tensor(header, "rope_factors_short.weight")),
            "original_max_position_embeddings": int(_require(header, f"{arch}.rope.scaling.original_context_length")),
        }
        if f"{arch}.rope.scaling.attn_factor" in meta:
            params["attention_factor"] = float(meta[f"{arch}.rope.scaling.attn_factor"])
    return params


def _vector(header: GGUFHeader, tensor) -> list[float]:
    buf = np.memmap(header.path, dtype=np.uint8, mode="r")
    return dequantize_tensor(buf, tensor).reshape(-1).tolist()


def _require_tensor(header: GGUFHeader, name: str):
    if name not in header.tensors:
        raise GGUFError(f"{header.path}: missing tensor {name!r}")
    return header.tensors[name]


def _token_id(meta: dict, key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    return None if value is None else int(value)


def gguf_hf_config(path: str | Path) -> dict:
    """A config.json-style dict for a GGUF file, for the model classes' `from_hf`."""
    header = read_gguf_header(path)
    architecture = check_supported(header)
    meta, arch = header.metadata, header.metadata["general.architecture"]
    num_heads = int(_require(header, f"{arch}.attention.head_count"))
    hidden = int(_require(header, f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFError(f"{header.path}: partial RoPE ({rope_dims} of {head_dim} dimensions) is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        vocab = header.tensors["token_embd.weight"].shape[0]
    eos = [i for i in (_token_id(meta, "eos_token_id"), _token_id(meta, "eot_token_id")) if i is not None]
    return {
        "architectures": [architecture],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": int(_require(header, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "intermediate_size": int(_require(header, f"{arch}.feed_forward_length")),
        "max_position_embeddings": int(_require(header, f"{arch}.context_length")),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": _rope_parameters(header, arch),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in header.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in header.tensors,
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "bos_token_id": _token_id(meta, "bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos)) or None,
        "pad_token_id": _token_id(meta, "padding_token_id"),
        "dtype": "float32",  # weights are dequantized to float32 before the engine's dtype
        **_ARCH_FIELDS.get(arch, lambda header: {})(header),
    }


def _gemma_fields(header: GGUFHeader, arch: str, num_layers_27b: int) -> dict:
    """What Gemma 2 and 3 share in llama.cpp's terms: the window in the metadata, the query
    scale implied by the size (as llama.cpp does: 1 / sqrt(hidden / heads) for the 27B, whose
    layer count names it, 1 / sqrt(head_dim) otherwise)."""
    meta = header.metadata
    hidden, heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
        "query_pre_attn_scalar": hidden // heads if meta[f"{arch}.block_count"] == num_layers_27b else head_dim,
        "tie_word_embeddings": "output.weight" not in header.tensors,
    }


def _gemma2_fields(header: GGUFHeader) -> dict:
    """Gemma 2 (the 27B: 46 layers): the soft-caps in the metadata."""
    meta = header.metadata
    return {
        **_gemma_fields(header, "gemma2", num_layers_27b=46),
        "attn_logit_softcapping": meta.get("gemma2.attn_logit_softcapping"),
        "final_logit_softcapping": meta.get("gemma2.final_logit_softcapping"),
    }


def _gemma3_fields(header: GGUFHeader) -> dict:
    """Gemma 3 (the 27B: 62 layers): the global layers' RoPE (base, linear factor) in the
    metadata; the sliding layers' base (10000) and the 5:1 pattern fixed by llama.cpp."""
    return {
        **_gemma_fields(header, "gemma3", num_layers_27b=62),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
    }


# tensors llama.cpp stores for RoPE, read into rope_parameters: Llama 3.1+ `freq_factors`,
# Phi-3 LongRoPE's `long_factor` / `short_factor`
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# general.architecture -> config fields beyond the common ones
_ARCH_FIELDS = {"gemma2": _gemma2_fields, "gemma3": _gemma3_fields, "phi3": lambda header: {
    "sliding_window": header.metadata.get("phi3.attention.sliding_window"),
}}  # fmt: skip
# architectures whose q / k rows llama.cpp's converter permutes (the others use NeoX RoPE as is)
_PERMUTED_ARCHITECTURES = ("llama",)
# llama.cpp stores Gemma's RMSNorm weights as 1 + w: the offset comes off at load
_NORM_OFFSET_ARCHITECTURES = ("gemma2", "gemma3")


# --------------------------------------------------------------------------- weights

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# Gemma 2's four norms per layer (llama.cpp's names differ from the Llama ones they reuse)
_GEMMA2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


# Phi-3's fused projections: q|k|v in attn_qkv, gate|up in ffn_up
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_ARCH_LAYER_NAMES = {"gemma2": _GEMMA2_LAYER_NAMES, "gemma3": _GEMMA2_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; unknown names unchanged."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return gguf_name


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (pair, 2) -> (2, pair)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(buf: np.ndarray, tensor: GGUFTensor) -> np.ndarray:
    """float32 array of `tensor.shape` from the file's bytes."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = buf[tensor.offset : tensor.offset + tensor.num_bytes]
    rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
    values = dequantize(raw.reshape(rows, -1), GGMLQuantizationType(tensor.ggml_type))
    return values.reshape(tensor.shape).astype(np.float32, copy=False)


def weight_formats(header: GGUFHeader) -> dict[str, GroupQuantFormat]:
    """HF weight name -> format, for every 2-D tensor of a type kept quantized."""
    formats = {}
    for tensor in header.tensors.values():
        type_name = _ggml_type_name(tensor.ggml_type)
        if type_name in KEPT_QUANTIZED_TYPES and len(tensor.shape) == 2:
            formats[hf_tensor_name(tensor.name, header.metadata.get("general.architecture", "llama"))] = GroupQuantFormat(
                type_name, KEPT_QUANTIZED_TYPES[type_name], GGML_BLOCK_SIZE
            )
    return formats


def quantized_tensor(buf: np.ndarray, tensor: GGUFTensor) -> QuantizedTensor:
    """Codes, scales and offsets of a Q4_0 / Q4_1 / Q8_0 tensor; `.dequantize()` equals
    `dequantize_tensor` bit for bit (the same float32 products and sums as ggml's).

        Q4_0  block: d f16, 16 bytes of nibbles     w = d * (q - 8)   -> code q,       offset -8d
        Q4_1  block: d f16, m f16, 16 bytes         w = d * q + m     -> code q,       offset m
        Q8_0  block: d f16, 32 int8                 w = d * q         -> code q + 128, offset -128d
    A block's low nibbles are its elements 0..15, the high nibbles 16..31.
    """
    type_name = _ggml_type_name(tensor.ggml_type)
    rows, cols = tensor.shape
    raw = buf[tensor.offset : tensor.offset + tensor.num_bytes]
    blocks = raw.reshape(rows * cols // GGML_BLOCK_SIZE, -1)  # [blocks, bytes per block]
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    if type_name == "Q8_0":
        codes = (blocks[:, 2:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        offset = -128 * scale
    else:
        nibbles = blocks[:, -16:]
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # [blocks, 32]
        if type_name == "Q4_1":
            offset = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        else:
            offset = -8 * scale
    groups = cols // GGML_BLOCK_SIZE
    return QuantizedTensor(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, cols)),
        torch.from_numpy(np.ascontiguousarray(scale).reshape(rows, groups)),
        torch.from_numpy(np.ascontiguousarray(offset).reshape(rows, groups)),
    )


def iter_gguf_weights(
    path: str | Path, hf_config: dict, quantized: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, tensor on CPU) for every tensor of a GGUF file: float32, or for the
    HF weight names in `quantized` the three tensors `<module>.weight_codes / _scales /
    _offsets` of quant.GroupQuantLinearMethod."""
    header = read_gguf_header(path)
    arch = hf_config["model_type"]
    heads = {"q_proj": hf_config["num_attention_heads"], "k_proj": hf_config["num_key_value_heads"]}
    if arch not in _PERMUTED_ARCHITECTURES:
        heads = {}
    buf = np.memmap(header.path, dtype=np.uint8, mode="r")
    for tensor in header.tensors.values():
        if tensor.name in CONFIG_TENSORS:
            continue  # in the config (rope_parameters)
        name = hf_tensor_name(tensor.name, arch)
        proj = name.rsplit(".", 2)[-2]
        num_heads = heads[proj] if proj in heads and ".self_attn." in name else None
        if name in quantized:
            q = quantized_tensor(buf, tensor)
            prefix = name.removesuffix(".weight")
            for suffix, part in zip(("codes", "scales", "offsets"), (q.codes, q.scales, q.offsets)):
                part = part if num_heads is None else torch.from_numpy(_unpermute(part.numpy(), num_heads).copy())
                yield f"{prefix}.weight_{suffix}", part
            continue
        values = dequantize_tensor(buf, tensor)
        if num_heads is not None:
            values = _unpermute(values, num_heads)
        if arch in _NORM_OFFSET_ARCHITECTURES and name.endswith("norm.weight"):  # q/k norms too
            values = values - 1.0
        yield name, torch.from_numpy(np.require(values, requirements=["C", "W"]))  # F32 views are read-only


# --------------------------------------------------------------------------- tokenizer


def _tokenizer_cache_dir(path: Path) -> Path:
    from .tiny import cache_root

    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf-tokenizers" / f"{path.stem}-{key}"


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer and chat template of a GGUF file, through transformers' GGUF conversion.

    The conversion takes seconds (it reads the vocabulary with the `gguf` package), so its
    result is saved once per file version under the model cache and loaded from there;
    concurrent first uses each convert into a temp dir and the first rename wins.
    """
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    cached = _tokenizer_cache_dir(path)
    if not (cached / "tokenizer_config.json").is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{cached.name}.tmp-", dir=cached.parent))
        try:
            AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(scratch))
            os.rename(scratch, cached)
        except OSError:
            if not (cached / "tokenizer_config.json").is_file():
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(cached))
