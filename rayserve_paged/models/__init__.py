"""Models: TP-ready layers, OPT and Llama for paged attention, the HF checkpoint loader, and
deterministic tiny checkpoints (`make_tiny_model`, `resolve_model("tiny-opt")`)."""

from .loader import ModelConfig, WeightLoadError, get_model_config, load_model
from .tiny import TINY_MODELS, make_tiny_model, resolve_model

__all__ = [
    "TINY_MODELS",
    "ModelConfig",
    "WeightLoadError",
    "get_model_config",
    "load_model",
    "make_tiny_model",
    "resolve_model",
]
