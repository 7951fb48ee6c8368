"""/v1/embeddings (OpenAI's shape) over the generation pipeline: one pooling request per
input, on a model served with task `embed`; the checkpoint's pooling rule (engine/pooling.py),
`dimensions` cut before the normalization, vectors as floats or base64 float32."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from rayserve_paged.core.sequence import PoolingParams, SamplingParams
from rayserve_paged.deployments.admission import Admission
from rayserve_paged.deployments.errors import bad_request
from rayserve_paged.deployments.protocol import MAX_PROMPTS, PROMPT_SCHEMAS, RequestModel, check_prompt_shape
from rayserve_paged.deployments.serving.pipeline import GenerationPipeline, Prompt, check_task, log_unknown_fields


# --------------------------------------------------------------------------- request and response models


class EmbeddingRequest(RequestModel):
    """POST /v1/embeddings."""

    model: str | None = Field(None, description="The served model name; omitted = the served model.")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description=(
            "A string, a list of strings, a list of token ids or a list of token-id lists (one vector each); "
            f"at most {MAX_PROMPTS} inputs, none empty, each shorter than the model's context."
        ),
        json_schema_extra=lambda schema: schema.update(anyOf=PROMPT_SCHEMAS),
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: each vector's little-endian float32 bytes."
    )
    dimensions: int | None = Field(
        None, ge=1, description="Keep the first `dimensions` numbers (before normalizing; Matryoshka models)."
    )
    user: str | None = Field(None, description="The end user (ignored).")

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value):
        return check_prompt_shape(value)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


# --------------------------------------------------------------------------- the route


class EmbeddingServing:
    def __init__(self, pipeline: GenerationPipeline) -> None:
        self.pipeline = pipeline

    async def create_embedding(self, request: EmbeddingRequest, admission: Admission | None = None) -> EmbeddingResponse:
        inputs = request.input if isinstance(request.input, list) and not isinstance(request.input[0], int) else [request.input]
        prompts, vectors = await self.embed(request, inputs, "input", admission, request.dimensions)
        data = [EmbeddingData(index=i, embedding=_encoded(v, request.encoding_format)) for i, v in enumerate(vectors)]
        num_tokens = sum(len(p.token_ids) for p in prompts)
        return EmbeddingResponse(
            id=f"embd-{uuid.uuid4().hex}", created=int(time.time()), model=self.pipeline.model_name(request),
            data=data, usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )  # fmt: skip

    async def embed(
        self, request, inputs: list[str | list[int]], field: str, admission: Admission | None,
        dimensions: int | None = None, normalize: bool | None = None,
    ) -> tuple[list[Prompt], list[list[float]]]:  # fmt: skip
        """Each input's tokens and pooled vector, in order (a 400 naming `field` for an
        input that cannot be embedded; for a model not served for `embed`, one naming model).
        `normalize` None: the checkpoint's rule."""
        pipeline = self.pipeline
        log_unknown_fields(request)
        await pipeline.check_model(request.model)
        info = await pipeline.model_info()
        check_task(info, "embed")
        if dimensions is not None and dimensions > info["hidden_size"]:
            raise bad_request(f"dimensions: at most this model's {info['hidden_size']} (got {dimensions})")
        rule = info["pooling"] if normalize is None else {**info["pooling"], "normalize": normalize}
        pooling = PoolingParams(**rule, dimensions=dimensions)
        priority = admission.priority_of(None) if admission is not None else 0
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling, priority=priority)
        prompts = await pipeline.in_pool(lambda: [self._prompt(p, field) for p in inputs])
        for prompt in prompts:
            pipeline.check_fits(prompt.token_ids, None, info, field, field)
        response_id = f"embd-{uuid.uuid4().hex}"
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        results = await pipeline.pool(request, prompts, params, request_ids, admission, field)
        return prompts, [result.pooled for result in results]

    def _prompt(self, value: str | list[int], field: str) -> Prompt:
        if isinstance(value, str):
            return Prompt(value, self.pipeline.encode(value, field))
        return Prompt(None, list(value))


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
