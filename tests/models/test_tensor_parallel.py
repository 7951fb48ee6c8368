"""Sharding is right: N ranks, each loading its shards from the full checkpoint, together
give the single-rank logits. Ranks run as threads joined by in-memory collectives (no
torch.distributed), which checks the shard arithmetic of every layer and of the loader."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from rayserve_paged.models.layers import ParallelState
from rayserve_paged.models.loader import get_model_config, load_model

from .paged import PagedRunner


class ThreadCollectives:
    """Every rank posts a tensor, every rank gets all of them in rank order."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.posted: list[Any] = [None] * size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.posted[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.posted)
        self.barrier.wait()  # nobody posts the next round before all have read this one
        return parts


@dataclass(frozen=True)
class ThreadParallelState(ParallelState):
    collectives: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.collectives.exchange(self.tp_rank, x)
        return x.copy_(torch.stack(parts).sum(0))

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.collectives.exchange(self.tp_rank, x), dim=dim)


def run_on_ranks(fn, tp_size: int) -> list:
    """fn(parallel) on tp_size thread ranks joined by in-memory collectives; results by rank."""
    collectives = ThreadCollectives(tp_size)
    ranks = [ThreadParallelState(rank, tp_size, collectives=collectives) for rank in range(tp_size)]
    with ThreadPoolExecutor(tp_size) as pool:
        return list(pool.map(fn, ranks))


def _generate(path, parallel=None) -> list[torch.Tensor]:
    """Logits of a packed prefill of two prompts and then three greedy decode steps."""
    config = get_model_config(path)
    tp_size = parallel.tp_size if parallel else 1
    model = load_model(path, parallel=parallel)
    runner = PagedRunner(model, config.num_layers, config.num_kv_heads_per_rank(tp_size), config.head_dim)
    prompts = {0: [1, 40, 41, 42, 43, 44], 1: [1, 9, 8]}
    logits = [runner.step(list(prompts.items()))]
    for _ in range(3):
        tokens = logits[-1].argmax(-1).tolist()
        logits.append(runner.step([], list(zip(prompts, tokens))))
    return logits


@pytest.mark.parametrize(
    "arch, tp_size, overrides",
    [
        ("opt", 2, {}),
        ("opt", 2, {"vocab_size": 515, "tie_word_embeddings": True}),  # padded vocabulary shards
        ("llama", 2, {}),  # one KV head per rank
        ("llama", 4, {"tie_word_embeddings": True}),  # 2 KV heads replicated over 4 ranks
    ],
)
def test_ranks_together_equal_one_rank(arch, tp_size, overrides, tiny_checkpoint):
    path = tiny_checkpoint(arch, **overrides)
    expected = _generate(path)
    for rank_logits in run_on_ranks(lambda parallel: _generate(path, parallel), tp_size):
        for got, want in zip(rank_logits, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_rank_holds_only_its_shard(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    full = load_model(path)
    half = load_model(path, parallel=ThreadParallelState(1, 2, collectives=ThreadCollectives(2)))
    attn_full, attn_half = full.model.layers[0].self_attn, half.model.layers[0].self_attn
    # rank 1 of 2: query heads 2..3 and KV head 1 of q|k|v; o_proj columns 32..63
    q_rows, kv_rows = slice(32, 64), slice(64 + 16, 64 + 32)
    qkv_half = attn_half.qkv_proj.weight
    assert qkv_half.shape == (32 + 16 + 16, 64)
    torch.testing.assert_close(qkv_half[:32], attn_full.qkv_proj.weight[q_rows], atol=0, rtol=0)
    torch.testing.assert_close(qkv_half[32:48], attn_full.qkv_proj.weight[kv_rows], atol=0, rtol=0)
    torch.testing.assert_close(attn_half.o_proj.weight, attn_full.o_proj.weight[:, 32:], atol=0, rtol=0)
    assert half.model.embed_tokens.weight.shape == (256, 64)
    torch.testing.assert_close(half.lm_head.weight, full.lm_head.weight[256:], atol=0, rtol=0)


def _gloo_rank(rank: int, tp_size: int, path: str, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp_size)
    try:
        config = get_model_config(path)
        model = load_model(path, tp_rank=rank, tp_size=tp_size)
        runner = PagedRunner(model, config.num_layers, config.num_kv_heads_per_rank(tp_size), config.head_dim)
        logits = runner.step([(0, [1, 40, 41, 42, 43, 44]), (1, [1, 9, 8])])
        if rank == 0:
            torch.save(logits, out_file)
    finally:
        dist.destroy_process_group()


def test_torch_distributed_gloo_two_ranks(tiny_checkpoint, tmp_path):
    """The real collectives (gloo, two processes) behind ParallelState."""
    import torch.multiprocessing as mp

    path = tiny_checkpoint("llama")
    out_file = tmp_path / "logits.pt"
    args = (2, str(path), str(tmp_path / "init"), str(out_file))
    mp.spawn(_gloo_rank, args=args, nprocs=2, join=True)
    torch.testing.assert_close(torch.load(out_file), _generate(path)[0], atol=1e-4, rtol=0)
