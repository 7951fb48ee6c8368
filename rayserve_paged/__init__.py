"""rayserve-paged: LLM serving with PagedAttention, delivered as a Ray Serve application."""

from rayserve_paged.core.lora import LoRARequest
from rayserve_paged.core.sequence import PoolingParams, SamplingParams, SamplingParamsError, StructuredOutputsParams

__all__ = ["LLM", "LoRARequest", "PoolingParams", "SamplingParams", "SamplingParamsError", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # torch-backed pieces load on first use, so `import rayserve_paged` stays light
    if name == "LLM":
        from rayserve_paged.engine.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from rayserve_paged.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'rayserve_paged' has no attribute {name!r}")
