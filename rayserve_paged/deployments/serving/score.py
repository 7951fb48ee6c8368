"""/v1/score and /v1/rerank (vLLM's shapes) on a model served with task embed: a pair's
score is the cosine of the two texts' embeddings (serving/embeddings.py), as vLLM scores
with an embedding model. Each distinct text is embedded once."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from rayserve_paged.deployments.admission import Admission
from rayserve_paged.deployments.errors import bad_request
from rayserve_paged.deployments.protocol import MAX_PROMPTS, RequestModel, check_unicode
from rayserve_paged.deployments.serving.embeddings import EmbeddingServing, EmbeddingUsage


def _texts(value) -> str | list[str]:
    """A non-empty string or a list of 1..MAX_PROMPTS non-empty strings."""
    items = value if isinstance(value, list) else [value]
    if not items or len(items) > MAX_PROMPTS:
        raise ValueError(f"give 1 to {MAX_PROMPTS} texts (got {len(items)})")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError("must be non-empty strings")
        check_unicode(item)
    return value


# --------------------------------------------------------------------------- request and response models


class ScoreRequest(RequestModel):
    """POST /v1/score: text_1 against each text_2 (one text_1), or pairwise (equal lengths)."""

    model: str | None = Field(None, description="The served model name; omitted = the served model.")
    text_1: str | list[str] = Field(description="A text, or a list paired with text_2's.")
    text_2: str | list[str] = Field(description="A text or a list of texts to score against text_1.")

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _check_texts(cls, value):
        return _texts(value)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(RequestModel):
    """POST /v1/rerank: documents ordered by their score against the query."""

    model: str | None = Field(None, description="The served model name; omitted = the served model.")
    query: str = Field(description="The query.")
    documents: list[str] = Field(description=f"1 to {MAX_PROMPTS} documents.")
    top_n: int | None = Field(None, ge=1, description="Return the best top_n (default: all).")

    @field_validator("query", "documents", mode="before")
    @classmethod
    def _check_texts(cls, value, info):
        if info.field_name == "query" and not isinstance(value, str):
            raise ValueError("must be a non-empty string")
        if info.field_name == "documents" and not isinstance(value, list):
            raise ValueError("must be a list of non-empty strings")
        return _texts(value)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


# --------------------------------------------------------------------------- the routes


class ScoreServing:
    def __init__(self, embedding: EmbeddingServing) -> None:
        self.embedding = embedding

    async def score(self, request: ScoreRequest, admission: Admission | None = None) -> ScoreResponse:
        first = request.text_1 if isinstance(request.text_1, list) else [request.text_1]
        second = request.text_2 if isinstance(request.text_2, list) else [request.text_2]
        if len(first) != 1 and len(first) != len(second):
            raise bad_request(f"text_1: one text, or as many as text_2 ({len(second)}); got {len(first)}")
        pairs = [(first[0] if len(first) == 1 else first[i], text) for i, text in enumerate(second)]
        scores, num_tokens = await self._cosines(request, pairs, "text_1", admission)
        return ScoreResponse(
            id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=self.embedding.pipeline.model_name(request),
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )  # fmt: skip

    async def rerank(self, request: RerankRequest, admission: Admission | None = None) -> RerankResponse:
        pairs = [(request.query, doc) for doc in request.documents]
        scores, num_tokens = await self._cosines(request, pairs, "documents", admission)
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[: request.top_n]
        results = [
            RerankResult(index=i, document=RerankDocument(text=request.documents[i]), relevance_score=scores[i])
            for i in order
        ]
        return RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}", model=self.embedding.pipeline.model_name(request), results=results,
            usage=RerankUsage(total_tokens=num_tokens),
        )  # fmt: skip

    async def _cosines(
        self, request, pairs: list[tuple[str, str]], field: str, admission: Admission | None
    ) -> tuple[list[float], int]:
        """Each pair's cosine, and the tokens embedded (each distinct text once)."""
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        prompts, vectors = await self.embedding.embed(request, texts, field, admission, normalize=True)
        by_text = dict(zip(texts, vectors))
        scores = [_cosine(by_text[a], by_text[b]) for a, b in pairs]
        return scores, sum(len(p.token_ids) for p in prompts)


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0
