"""Models: TP-ready layers, OPT and the decoder families of registry.py (Llama, Mistral,
Qwen2/3, Gemma 2/3, Phi-3) for paged attention, the HF checkpoint and GGUF loader, the
embedded SmolLM2 (`resolve_model("smollm2")`) and deterministic tiny checkpoints
(`make_tiny_model`, `resolve_model("tiny-opt")`)."""

from .gguf import GGUFError
from .loader import ModelConfig, WeightLoadError, get_model_config, load_model, load_tokenizer
from .tiny import BUILTIN_MODELS, TINY_MODELS, make_tiny_model, resolve_model

__all__ = [
    "BUILTIN_MODELS",
    "GGUFError",
    "TINY_MODELS",
    "ModelConfig",
    "WeightLoadError",
    "get_model_config",
    "load_model",
    "load_tokenizer",
    "make_tiny_model",
    "resolve_model",
]
