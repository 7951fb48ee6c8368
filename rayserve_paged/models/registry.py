"""Every architecture the project runs: one entry each, read by the loader (config.json's
`architectures`, else its `model_type`) and the GGUF reader (`general.architecture`).

Adding a family is a file with its DecoderForCausalLM subclass and a line here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .gemma2 import Gemma2ForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .opt import OPTForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM


@dataclass(frozen=True, slots=True)
class Architecture:
    hf_name: str  # config.json `architectures[0]`
    model_type: str  # config.json `model_type`
    gguf_name: str | None  # GGUF `general.architecture` this loader reads, if any
    model_class: type[nn.Module]  # has config_from_hf(hf_config) and map_weight_name(name)


ARCHITECTURES = (
    Architecture("OPTForCausalLM", "opt", None, OPTForCausalLM),
    Architecture("LlamaForCausalLM", "llama", "llama", LlamaForCausalLM),
    Architecture("MistralForCausalLM", "mistral", None, MistralForCausalLM),
    Architecture("Qwen2ForCausalLM", "qwen2", "qwen2", Qwen2ForCausalLM),
    Architecture("Qwen3ForCausalLM", "qwen3", "qwen3", Qwen3ForCausalLM),
    Architecture("Gemma2ForCausalLM", "gemma2", "gemma2", Gemma2ForCausalLM),
    Architecture("Gemma3ForCausalLM", "gemma3_text", "gemma3", Gemma3ForCausalLM),
    Architecture("Phi3ForCausalLM", "phi3", "phi3", Phi3ForCausalLM),
)
BY_HF_NAME = {a.hf_name: a for a in ARCHITECTURES}
BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES}
BY_GGUF_NAME = {a.gguf_name: a for a in ARCHITECTURES if a.gguf_name}
