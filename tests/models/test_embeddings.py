"""Pooling requests (LLM.embed, SamplingParams.pooling): the pooled final hidden states equal
HF's (AutoModel's last_hidden_state, float32) for last / mean / cls pooling, alone and
batched beside generation, with chunked prefill and a prefix cache holding the prompts."""

from __future__ import annotations

import random

import pytest
import torch

from rayserve_paged import LLM, PoolingParams, SamplingParams
from rayserve_paged.core.sequence import SamplingParamsError

from .families import write_family_checkpoint


@pytest.fixture(scope="module")
def checkpoint(family_checkpoint):
    return family_checkpoint


def _hf_pooled(hf, prompt: list[int], pooling: PoolingParams) -> torch.Tensor:
    with torch.no_grad():
        states = hf.model(torch.tensor([prompt])).last_hidden_state[0].float()  # [len, hidden]
    vector = {"last": states[-1], "mean": states.mean(dim=0), "cls": states[0]}[pooling.pooling]
    vector = vector[: pooling.dimensions]
    return torch.nn.functional.normalize(vector, dim=-1) if pooling.normalize else vector


def _cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0).item()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_pooled_equal_hf_alone_batched_chunked(family, checkpoint, hf_model):
    path = checkpoint(family)
    hf = hf_model(path)
    rng = random.Random(7)
    shared = [1] + [rng.randrange(3, 512) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 30)] + [[1, 9, 10]]
    llm = LLM(
        model=path, block_size=8, max_model_len=96, kv_cache_memory_gb=0.05, enable_prefix_caching=True,
        enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8,
    )  # fmt: skip
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompt_token_ids=[shared + [5]], sampling_params=plain, use_tqdm=False)  # caches the shared blocks
    for pooling in (PoolingParams("last"), PoolingParams("mean", normalize=False), PoolingParams("cls", dimensions=16)):
        alone = llm.embed(prompt_token_ids=prompts[:1], pooling_params=pooling, use_tqdm=False)
        mixed = llm.generate(  # embeddings in one scheduler with generation, chunked under a 16-token budget
            prompt_token_ids=[shared + [6], *prompts],
            sampling_params=[plain] + [SamplingParams(max_tokens=1, pooling=pooling)] * len(prompts),
            use_tqdm=False,
        )
        assert mixed[0].pooled is None and len(mixed[0].outputs[0].token_ids) == 4
        vectors = [out.pooled for out in mixed[1:]]
        assert all(out.outputs[0].token_ids == [] for out in mixed[1:])
        assert vectors[0] == pytest.approx(alone[0], abs=1e-5)
        for prompt, vector in zip(prompts, vectors):
            expected = _hf_pooled(hf, prompt, pooling)
            assert len(vector) == expected.numel()
            assert _cosine(vector, expected) >= 0.99999
            if not pooling.normalize:
                assert torch.allclose(torch.tensor(vector), expected, atol=1e-4)
            else:
                assert abs(torch.tensor(vector).norm().item() - 1) < 1e-5
    usage = llm.engine.block_manager.usage()
    assert usage.gpu_used == 0  # no KV kept after a pooling request


def test_pooling_params_are_checked():
    for bad in (dict(pooling="max"), dict(dimensions=0), dict(normalize="yes")):
        with pytest.raises(SamplingParamsError):
            PoolingParams(**bad)
    with pytest.raises(SamplingParamsError, match="n"):
        SamplingParams(n=2, pooling=PoolingParams())


def test_a_bare_decoder_checkpoint_embeds(tmp_path):
    """An embedding checkpoint saved from the bare decoder (Qwen3Model: no `model.` prefix,
    no LM head, here untied: the head is zeroed), as Qwen3-Embedding is, loads on its causal
    LM's skeleton."""
    import shutil

    from transformers import AutoModel

    full = write_family_checkpoint("qwen3", tmp_path / "full")
    bare = tmp_path / "bare"
    hf = AutoModel.from_pretrained(full, dtype=torch.float32).eval()
    hf.save_pretrained(bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (full / name).exists():
            shutil.copy(full / name, bare / name)
    assert type(hf).__name__ == "Qwen3Model"
    llm = LLM(model=str(bare), block_size=8, max_model_len=64, kv_cache_memory_gb=0.02)
    prompt = [1, *range(50, 70)]
    (vector,) = llm.embed(prompt_token_ids=[prompt], use_tqdm=False)
    with torch.no_grad():
        last = hf(torch.tensor([prompt])).last_hidden_state[0, -1]
    assert _cosine(vector, torch.nn.functional.normalize(last, dim=-1)) >= 0.99999
