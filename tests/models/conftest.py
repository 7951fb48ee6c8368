from __future__ import annotations

import pytest
import torch

from rayserve_paged import LLM
from rayserve_paged.models.loader import get_model_config, load_model
from rayserve_paged.models.tiny import make_tiny_model

from .families import write_family_checkpoint
from .paged import PagedRunner


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning
    worker threads make them many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """make(arch, **overrides) -> a tiny checkpoint dir, written once per session per arguments."""
    made = {}

    def make(arch: str, **overrides):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """make(family) -> the path of a random checkpoint of tests/models/families.py's
    `family`, written once per session."""
    made = {}

    def make(family: str) -> str:
        if family not in made:
            made[family] = str(write_family_checkpoint(family, tmp_path_factory.mktemp(f"family-{family}")))
        return made[family]

    return make


@pytest.fixture(scope="session")
def hf_model():
    """load(path) -> transformers AutoModelForCausalLM in float32, eval mode, cached."""
    from transformers import AutoModelForCausalLM

    loaded = {}

    def load(path):
        if path not in loaded:
            loaded[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return loaded[path]

    return load


def make_runner(path, **kwargs) -> PagedRunner:
    config = get_model_config(path)
    model = load_model(path, dtype=torch.float32)
    return PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_dim, **kwargs)


def preempting_llm(path, mode: str, num_blocks: int, max_model_len: int, chunk: int, max_num_seqs: int) -> LLM:
    """An engine of `num_blocks` 8-token blocks (few enough that the test's requests preempt,
    by `mode`), prefix caching on and prompts chunked `chunk` tokens per step."""
    return LLM(
        model=path, block_size=8, num_gpu_blocks_override=num_blocks, max_model_len=max_model_len,
        preemption_mode=mode, swap_space_gb=0.01, kv_cache_memory_gb=0.05, enable_prefix_caching=True,
        enable_chunked_prefill=True, max_num_batched_tokens=chunk, max_num_seqs=max_num_seqs,
    )  # fmt: skip


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of HF's model over one unpadded sequence."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()
