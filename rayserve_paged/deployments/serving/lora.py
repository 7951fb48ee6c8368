"""vLLM's runtime LoRA routes, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (served
with `allow_runtime_lora_updating`): their request models and handlers."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rayserve_paged.deployments.errors import OpenAIError, bad_request
from rayserve_paged.deployments.protocol import check_unicode
from rayserve_paged.deployments.serving.pipeline import GenerationPipeline

# --------------------------------------------------------------------------- request models

MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): register a PEFT LoRA directory under a name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS, description="What requests' `model` says.")
    lora_path: str = Field(
        min_length=1, max_length=MAX_LORA_PATH_CHARS,
        description="The adapter's directory on the replica (adapter_config.json, adapter_model.safetensors).",
    )  # fmt: skip

    _unicode = field_validator("lora_name", "lora_path")(check_unicode)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's): forget an adapter (requests running on it finish)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_int_id: int | None = Field(None, description="Accepted for vLLM's body; the name decides.")


# --------------------------------------------------------------------------- the routes


class LoRAServing:
    def __init__(self, pipeline: GenerationPipeline) -> None:
        self.pipeline = pipeline

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        name = request.lora_name
        if name == self.pipeline.served_model_name:
            raise bad_request(f"lora_name: {name!r} is the served model's name", param="lora_name")
        if name in await self.pipeline.lora_adapters():
            raise bad_request(f"lora_name: the LoRA adapter {name!r} has already been loaded", param="lora_name")
        try:
            await self.pipeline.client.load_lora_adapter(name, request.lora_path)
        except ValueError as exc:
            from rayserve_paged.models.lora import LoRAError  # torch: not at import (the app imports no torch)

            cause = getattr(exc, "cause", None)  # through Ray: the engine's own exception
            cause = cause if isinstance(cause, ValueError) else exc
            param = "lora_path" if isinstance(cause, LoRAError) else "lora_name"
            raise bad_request(f"{param}: {cause}", param=param) from None
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        name = request.lora_name
        if name not in await self.pipeline.lora_adapters() or not await self.pipeline.client.unload_lora_adapter(name):
            raise OpenAIError(
                404, f"lora_name: the LoRA adapter {name!r} cannot be found", param="lora_name", code="model_not_found"
            )
        return f"Success: LoRA adapter '{name}' removed successfully."
