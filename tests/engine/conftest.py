from __future__ import annotations

import pytest
import torch

from rayserve_paged.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory):
    """{"opt": dir, "llama": dir}: the tiny checkpoints, written once per session."""
    return {arch: str(make_tiny_model(arch, tmp_path_factory.mktemp(f"engine-{arch}"))) for arch in ("opt", "llama")}


@pytest.fixture(scope="session")
def hf_reference(tiny_paths):
    """load(arch) -> (HF model in float32, HF tokenizer), cached for the session."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = {}

    def load(arch):
        if arch not in cache:
            path = tiny_paths[arch]
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[arch] = (model, AutoTokenizer.from_pretrained(path))
        return cache[arch]

    return load


def hf_generate(model, prompt_ids: list[int], **kwargs) -> list[list[int]]:
    """HF generate on one unpadded prompt; returns each returned sequence's new tokens,
    with the padding after an early EOS removed."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), **kwargs)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    results = []
    for row in out.tolist():
        new = row[len(prompt_ids) :]
        for i, tok in enumerate(new):
            if tok in eos:
                new = new[: i + 1]
                break
        results.append(new)
    return results
