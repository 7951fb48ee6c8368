"""Our paged models against transformers, in float32: packed prefill, cached context, decode."""

from __future__ import annotations

import pytest
import torch

from .conftest import hf_logits, make_runner

ATOL = 1e-4

VARIANTS = [
    ("opt", {}),  # untied LM head
    ("opt", {"tie_word_embeddings": True}),
    # opt-350m layout: post-norm, no final norm, embeddings projected 32 <-> 64
    ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32, "tie_word_embeddings": True}),
    ("llama", {}),  # GQA: 4 query heads over 2 KV heads, untied
    # MQA, tied, with q/k/v/o and MLP biases (sharded through the fused layers)
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}),
]
IDS = ["opt", "opt-tied", "opt-350m-style", "llama-gqa", "llama-mqa-tied-bias"]

PROMPTS = [
    [1, 50, 60, 70, 80, 90, 100, 110, 120],  # crosses two 4-token blocks
    [1, 200, 201],
    [1, *range(300, 317)],  # 18 tokens: 5 blocks
    [1],
]


@pytest.fixture(params=VARIANTS, ids=IDS)
def checkpoint(request, tiny_checkpoint):
    arch, overrides = request.param
    return tiny_checkpoint(arch, **overrides)


def test_packed_prefill_matches_hf_at_every_position(checkpoint, hf_model):
    runner = make_runner(checkpoint)
    ours = runner.step([(i, p) for i, p in enumerate(PROMPTS)], all_logits=True)  # [sum(len), vocab]
    ref = torch.cat([hf_logits(hf_model(checkpoint), p) for p in PROMPTS])
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("split", [1, 4, 7])  # context inside a block, at a boundary, past one
def test_prefill_over_cached_context_matches_full_prefill(checkpoint, split):
    prompt = PROMPTS[2]
    full = make_runner(checkpoint).step([(0, prompt)])
    runner = make_runner(checkpoint)
    runner.step([(0, prompt[:split])])
    second = runner.step([(0, prompt[split:])])
    torch.testing.assert_close(second, full, atol=ATOL, rtol=0)


def test_decode_steps_match_hf(checkpoint, hf_model):
    """Greedy decoding, with a chunked prefill riding along in the same steps."""
    hf = hf_model(checkpoint)
    runner = make_runner(checkpoint)
    seqs = {0: list(PROMPTS[0]), 1: list(PROMPTS[1]), 3: list(PROMPTS[3])}
    logits = runner.step([(s, toks) for s, toks in seqs.items()])
    late = PROMPTS[2]  # prefilled 5 tokens per step while the others decode
    for step in range(6):
        for s, row in zip(seqs, logits[-len(seqs):]):
            torch.testing.assert_close(row, hf_logits(hf, seqs[s])[-1], atol=ATOL, rtol=0)
            seqs[s].append(int(row.argmax()))
        chunk = late[step * 5 : (step + 1) * 5]
        prefills = [(2, chunk)] if chunk else []
        logits = runner.step(prefills, [(s, toks[-1]) for s, toks in seqs.items()])
        if chunk:
            torch.testing.assert_close(logits[0], hf_logits(hf, late[: (step + 1) * 5])[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_greedy_tokens_equal_hf_generate(arch, tiny_checkpoint, hf_model):
    path = tiny_checkpoint(arch)
    hf = hf_model(path)
    runner = make_runner(path)
    prompts = {0: [1, 77, 78, 79], 1: [1, 400, 20, 30, 40, 50]}
    logits = runner.step(list(prompts.items()))
    generated = {s: [] for s in prompts}
    for _ in range(12):
        tokens = logits.argmax(-1).tolist()
        for s, token in zip(prompts, tokens):
            generated[s].append(token)
        logits = runner.step([], [(s, generated[s][-1]) for s in prompts])
    for s, prompt in prompts.items():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        eos = hf.generation_config.eos_token_id
        ours = generated[s][: generated[s].index(eos) + 1] if eos in generated[s] else generated[s]
        assert ours == out
