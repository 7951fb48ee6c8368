"""/v1/embeddings on a tiny random Qwen3 served with task embed (in process, no Ray): the
vectors equal HF's pooled hidden states (last token, normalized: Qwen3-Embedding's rule),
batched and chunked; base64 and dimensions; the openai client; every malformed body a 4xx;
routes of the other task a 400."""

from __future__ import annotations

import base64
import json
import struct

import pytest
import torch

from rayserve_paged.config import EngineConfig
from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.engine.pooling import PoolingConfigError, checkpoint_pooling
from tests.deployments.conftest import asgi_client, idle_client, openai_client
from tests.models.families import write_family_checkpoint

pytestmark = pytest.mark.anyio

EMBED = "tiny-qwen3-embed"
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog and keeps on running far away", "a"]


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    return str(write_family_checkpoint("qwen3", tmp_path_factory.mktemp("embed-qwen3")))


@pytest.fixture(scope="module")
def embed_engine(qwen3_path) -> LLMEngine:
    config = EngineConfig(
        model=qwen3_path, device="cpu", task="embed", max_model_len=64, block_size=8, num_gpu_blocks_override=64,
        enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8,
    )  # fmt: skip
    return LLMEngine(config)


@pytest.fixture(scope="module")
def hf_embed(qwen3_path):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(qwen3_path, dtype=torch.float32).eval()

    def of(ids: list[int], dimensions: int | None = None) -> torch.Tensor:
        with torch.no_grad():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1].float()
        return torch.nn.functional.normalize(last[:dimensions], dim=-1)

    return of


@pytest.fixture
async def embed_app(embed_engine):
    async with idle_client(embed_engine) as client:
        yield create_openai_app(client, embed_engine.tokenizer, EMBED)


def _cosine(a, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0).item()


async def test_openai_client_embeddings_equal_hf(embed_app, embed_engine, hf_embed):
    async with openai_client(embed_app) as client:
        response = await client.embeddings.create(model=EMBED, input=TEXTS)
        alone = await client.embeddings.create(model=EMBED, input=TEXTS[1])
    ids = [embed_engine.tokenizer(t).input_ids for t in TEXTS]
    assert [d.index for d in response.data] == [0, 1, 2]
    for item, prompt in zip(response.data, ids):
        assert _cosine(item.embedding, hf_embed(prompt)) >= 0.99999
    assert alone.data[0].embedding == pytest.approx(response.data[1].embedding, abs=1e-5)
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    assert response.model == EMBED


async def test_token_ids_dimensions_and_base64(embed_app, hf_embed):
    ids = [[1, *range(40, 60)], [1, 7]]
    async with asgi_client(embed_app) as http:
        floats = (await http.post("/v1/embeddings", json={"input": ids, "dimensions": 16})).json()
        packed = (await http.post("/v1/embeddings", json={"input": ids, "dimensions": 16, "encoding_format": "base64"})).json()
        one = (await http.post("/v1/embeddings", json={"input": ids[0]})).json()
    assert len(one["data"]) == 1 and _cosine(one["data"][0]["embedding"], hf_embed(ids[0])) >= 0.99999
    for f, b, prompt in zip(floats["data"], packed["data"], ids):
        raw = base64.b64decode(b["embedding"])
        decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert len(decoded) == 16 == len(f["embedding"])
        assert decoded == pytest.approx(f["embedding"], abs=1e-6)
        assert _cosine(f["embedding"], hf_embed(prompt, 16)) >= 0.99999
        assert abs(sum(x * x for x in f["embedding"]) - 1) < 1e-5  # cut first, then normalized


BAD_BODIES = [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": 5}, "input"),
    ({"input": ["a", [1]]}, "input"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 10_000}, "dimensions"),
    ({"input": "hi", "dimensions": "8"}, "dimensions"),
    ({"input": [1, 999_999]}, "input"),
    ({"input": [1] * 200}, "input"),
    ({"input": ["x"] * 200}, "input"),
]


async def test_malformed_bodies_are_4xx(embed_app):
    async with asgi_client(embed_app) as http:
        for body, field in BAD_BODIES:
            response = await http.post("/v1/embeddings", json=body)
            assert response.status_code == 400, (body, response.text)
            assert field in response.text, (body, response.text)
        not_json = await http.post("/v1/embeddings", content=b"{", headers={"content-type": "application/json"})
        assert not_json.status_code == 400
        unknown = await http.post("/v1/embeddings", json={"input": "hi", "model": "nope"})
        assert unknown.status_code == 404


async def test_each_task_answers_only_its_routes(embed_app, http):
    async with asgi_client(embed_app) as embed_http:
        response = await embed_http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 400 and "embed" in response.text
    response = await http.post("/v1/embeddings", json={"input": "hi"})  # the tiny OPT, served for generate
    assert response.status_code == 400 and "generate" in response.text


def test_checkpoint_pooling_rules(tmp_path):
    assert (checkpoint_pooling(str(tmp_path)).pooling, checkpoint_pooling(str(tmp_path)).normalize) == ("last", True)
    (tmp_path / "1_Pooling").mkdir()
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    rule = checkpoint_pooling(str(tmp_path))
    assert (rule.pooling, rule.normalize) == ("mean", False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    rule = checkpoint_pooling(str(tmp_path))
    assert (rule.pooling, rule.normalize) == ("last", True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(PoolingConfigError, match="max_tokens"):
        checkpoint_pooling(str(tmp_path))


async def test_score_and_rerank_are_cosines_of_embeddings(embed_app, embed_engine, hf_embed):
    query, docs = TEXTS[0], TEXTS[1:] + ["Hello there world"]
    vector = {t: hf_embed(embed_engine.tokenizer(t).input_ids) for t in [query, *docs]}
    expected = [torch.dot(vector[query], vector[d]).item() for d in docs]
    async with asgi_client(embed_app) as http:
        one_to_many = (await http.post("/v1/score", json={"text_1": query, "text_2": docs})).json()
        pairwise = (await http.post("/v1/score", json={"text_1": [query] * 3, "text_2": docs})).json()
        reranked = (await http.post("/v1/rerank", json={"query": query, "documents": docs, "top_n": 2})).json()
        bad = [
            await http.post("/v1/score", json=body)
            for body in ({"text_1": [query, query], "text_2": docs}, {"text_1": query, "text_2": []},
                         {"text_1": "", "text_2": "a"}, {"text_1": query})
        ] + [
            await http.post("/v1/rerank", json=body)
            for body in ({"query": query, "documents": []}, {"query": query, "documents": docs, "top_n": 0},
                         {"query": 3, "documents": docs}, {"query": query, "documents": "a"})
        ]  # fmt: skip
    for body in (one_to_many, pairwise):
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    best = sorted(range(3), key=lambda i: expected[i], reverse=True)[:2]
    assert [r["index"] for r in reranked["results"]] == best
    assert [r["relevance_score"] for r in reranked["results"]] == pytest.approx([expected[i] for i in best], abs=1e-5)
    assert reranked["results"][0]["document"]["text"] == docs[best[0]]
    assert all(r.status_code == 400 for r in bad), [r.text for r in bad]
