"""LoRA on the model's layers: each row's adapter as PeftModel computes it, in one packed
step with other adapters and the base model; TP ranks together equal one rank (A cut for
row-parallel layers, B for column-parallel ones, KV heads replicated as the base weight)."""

from __future__ import annotations

import pytest
import torch

from rayserve_paged.models.loader import get_model_config, load_model
from rayserve_paged.models.lora import LoRAPool, lora_layers, read_peft_adapter
from tests.peft_adapters import peft_model, write_adapter

from .conftest import hf_logits
from .paged import PagedRunner
from .test_tensor_parallel import run_on_ranks

PROMPTS = {0: [1, 40, 41, 42, 43, 44], 1: [1, 9, 8], 2: [1, 17, 30, 5]}  # seq id -> prompt
SLOTS = {0: 0, 1: 1, 2: -1}  # seq id -> adapter slot (-1: the base model)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """arch -> [two adapter dirs]: every projection at r=8, and q/v at r=4."""
    root = tmp_path_factory.mktemp("lora-models")
    return {
        arch: [
            str(write_adapter(tiny_checkpoint(arch), root / f"{arch}-0", arch, "all", 8, 16, seed=1)),
            str(write_adapter(tiny_checkpoint(arch), root / f"{arch}-1", arch, "attn", 4, 4, seed=2)),
        ]
        for arch in ("opt", "llama")
    }


def _activate(pool: LoRAPool, slot: int, adapter_dir) -> None:
    """Read the adapter into the pool's CPU memory (as registration does), then into the slot."""
    adapter = read_peft_adapter(adapter_dir, pool.max_lora_rank)
    key = (slot + 1, str(adapter_dir), adapter.digest)
    pool.add(key, adapter)
    pool.activate(slot, key)


def _run(path, adapter_dirs, parallel=None) -> list[torch.Tensor]:
    """Logits of a packed prefill (three prompts on slots 0, 1 and the base) and two decodes."""
    config = get_model_config(path)
    tp_size = parallel.tp_size if parallel else 1
    model = load_model(path, parallel=parallel)
    pool = LoRAPool(model, max_loras=2, max_lora_rank=8)
    for slot, adapter in enumerate(adapter_dirs):
        _activate(pool, slot, adapter)
    runner = PagedRunner(model, config.num_layers, config.num_kv_heads_per_rank(tp_size), config.head_dim)
    pool.batch.set_step([SLOTS[s] for s, p in PROMPTS.items() for _ in p], "cpu")
    logits = [runner.step(list(PROMPTS.items()), all_logits=True)]
    last = {s: logits[0][end - 1] for s, end in zip(PROMPTS, torch.tensor([len(p) for p in PROMPTS.values()]).cumsum(0))}
    tokens = {s: int(row.argmax()) for s, row in last.items()}
    for _ in range(2):
        pool.batch.set_step([SLOTS[s] for s in PROMPTS], "cpu")
        logits.append(runner.step([], list(tokens.items())))
        tokens = dict(zip(PROMPTS, logits[-1].argmax(-1).tolist()))
    return logits


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_each_row_gets_its_adapter(tiny_checkpoint, hf_model, adapters, arch):
    path = tiny_checkpoint(arch)
    prefill = _run(path, adapters[arch])[0]
    references = [peft_model(path, adapters[arch][0]), peft_model(path, adapters[arch][1]), hf_model(path)]
    offset = 0
    for seq_id, prompt in PROMPTS.items():
        want = hf_logits(references[SLOTS[seq_id]], prompt)
        torch.testing.assert_close(prefill[offset : offset + len(prompt)], want, atol=1e-4, rtol=1e-4)
        offset += len(prompt)
    base = hf_logits(hf_model(path), PROMPTS[0])
    assert (prefill[: len(PROMPTS[0])] - base).abs().max() > 0.1  # the adapter changes the logits


@pytest.mark.parametrize("arch, tp_size", [("opt", 2), ("llama", 2), ("llama", 4)])  # llama 4: KV heads replicated
def test_ranks_together_equal_one_rank(tiny_checkpoint, adapters, arch, tp_size):
    path = tiny_checkpoint(arch)
    expected = _run(path, adapters[arch])
    for rank_logits in run_on_ranks(lambda parallel: _run(path, adapters[arch], parallel), tp_size):
        for got, want in zip(rank_logits, expected, strict=True):
            torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-4)  # sums in another order


def test_a_rank_holds_its_shard_of_the_adapter(tiny_checkpoint, adapters):
    from .test_tensor_parallel import ThreadCollectives, ThreadParallelState

    path = tiny_checkpoint("llama")
    full = LoRAPool(load_model(path), 1, 8)
    half = LoRAPool(load_model(path, parallel=ThreadParallelState(1, 2, collectives=ThreadCollectives(2))), 1, 8)
    for pool in (full, half):
        _activate(pool, 0, adapters["llama"][0])
    name = "model.layers.0.self_attn"
    qkv_full, qkv_half = full.layers[f"{name}.qkv_proj"], half.layers[f"{name}.qkv_proj"]
    # column-parallel: all of A (q | k | v blocks of 8), rank 1's rows of B (q rows 32..63, KV head 1)
    assert qkv_half.lora_a.shape == (1, 24, 64) and qkv_half.lora_b.shape == (1, 64, 24)
    torch.testing.assert_close(qkv_half.lora_a, qkv_full.lora_a, atol=0, rtol=0)
    torch.testing.assert_close(qkv_half.lora_b[0, :32], qkv_full.lora_b[0, 32:64], atol=0, rtol=0)
    torch.testing.assert_close(qkv_half.lora_b[0, 32:48], qkv_full.lora_b[0, 80:96], atol=0, rtol=0)
    assert not qkv_full.lora_b[0, :32, 8:].any()  # block-diagonal: q's rows take only q's rank columns
    # row-parallel: rank 1's columns of A, all of B
    o_full, o_half = full.layers[f"{name}.o_proj"], half.layers[f"{name}.o_proj"]
    torch.testing.assert_close(o_half.lora_a[0], o_full.lora_a[0, :, 32:], atol=0, rtol=0)
    torch.testing.assert_close(o_half.lora_b, o_full.lora_b, atol=0, rtol=0)
    assert sorted(lora_layers(full.model)) == sorted(
        f"model.layers.{i}.{m}" for i in range(2)
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    )  # fmt: skip


FAMILY_TARGETS = {
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],  # q/k/v biases
    "gemma2": ["q_proj", "v_proj", "o_proj", "down_proj"],  # soft-caps, norm offsets
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # fused in the checkpoint: one A per module
}


@pytest.mark.parametrize("family", sorted(FAMILY_TARGETS))
def test_decoder_families_equal_peft(family, tmp_path, hf_model):
    """The families on the decoder skeleton take adapters on the same layers (Phi-3's fused
    modules split into the pieces of our fused layers, sharing their A)."""
    from .families import write_family_checkpoint

    path = str(write_family_checkpoint(family, tmp_path / family))
    adapter = str(write_adapter(path, tmp_path / "lora", family, FAMILY_TARGETS[family], 8, 16, seed=4))
    config = get_model_config(path)
    model = load_model(path)
    pool = LoRAPool(model, max_loras=1, max_lora_rank=8)
    _activate(pool, 0, adapter)
    runner = PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_dim)
    prompts = [(0, PROMPTS[0]), (2, PROMPTS[2])]  # the first on the adapter, the second on the base model
    pool.batch.set_step([0] * len(PROMPTS[0]) + [-1] * len(PROMPTS[2]), "cpu")
    logits = runner.step(prompts, all_logits=True)
    n = len(PROMPTS[0])
    torch.testing.assert_close(logits[:n], hf_logits(peft_model(path, adapter), PROMPTS[0]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[n:], hf_logits(hf_model(path), PROMPTS[2]), atol=1e-4, rtol=1e-4)
    assert (logits[:n] - hf_logits(hf_model(path), PROMPTS[0])).abs().max() > 0.1


def test_a_weights_file_over_the_size_limit_is_refused_before_it_is_read(tiny_checkpoint, tmp_path):
    from rayserve_paged.models.lora import LoRAError

    adapter = write_adapter(tiny_checkpoint("llama"), tmp_path / "lora", "llama", "attn", 4, 8, seed=1)
    size = (adapter / "adapter_model.safetensors").stat().st_size
    with pytest.raises(LoRAError, match=r"adapter_model.safetensors is .* MiB, above max_lora_size_mb"):
        read_peft_adapter(adapter, 8, max_bytes=size - 1)
    assert read_peft_adapter(adapter, 8, max_bytes=size).num_bytes > 0
