"""A bounded soak: a mixed workload with preemption (both modes), shared prefixes, n > 1,
best_of, beam search and aborts. At the end no block is in use, resident memory did not grow
across the second half, and every request either completed or was cleanly aborted."""

from __future__ import annotations

import gc
import random

import pytest

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.llm_engine import LLMEngine

RSS_TOLERANCE_BYTES = 16 << 20  # allocator noise; a leak of per-request state would be far larger


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "sample", "parallel", "best_of", "beam"])
    max_tokens = rng.randint(4, 40)
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if kind == "sample":
        return SamplingParams(temperature=0.9, top_p=0.9, max_tokens=max_tokens, seed=rng.randint(0, 99))
    if kind == "parallel":
        return SamplingParams(n=rng.randint(2, 3), temperature=1.0, max_tokens=max_tokens)
    if kind == "best_of":
        return SamplingParams(n=1, best_of=3, temperature=1.0, max_tokens=max_tokens)
    return SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=max_tokens)


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    prefix = rng.choice(prefixes)[: rng.randint(0, 48)]
    return prefix + [rng.randint(10, 500) for _ in range(rng.randint(1, 40))]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak_mixed_workload_leaves_nothing_behind(tiny_paths, mode):
    rng = random.Random(7)
    engine = LLMEngine(
        EngineConfig(
            model=tiny_paths["opt"], max_model_len=256, num_gpu_blocks_override=24, swap_space_gb=0.02,
            preemption_mode=mode, max_num_seqs=16,
        )
    )  # fmt: skip
    prefixes = [[rng.randint(10, 500) for _ in range(48)] for _ in range(3)]
    num_requests, aborted, completed, next_id = 240, set(), set(), 0
    rss, steps = [], 0
    while next_id < num_requests or engine.has_unfinished_requests():
        steps += 1
        while next_id < num_requests and engine.num_unfinished_requests() < 12:
            engine.add_request(f"s{next_id}", None, _params(rng), prompt_token_ids=_prompt(rng, prefixes))
            next_id += 1
        for out in engine.step():
            if out.finished:
                assert out.error is None and all(c.finish_reason in ("stop", "length") for c in out.outputs)
                completed.add(out.request_id)
        if rng.random() < 0.03 and engine.scheduler.groups:
            victim = rng.choice(sorted(engine.scheduler.groups))
            assert engine.abort_request(victim)
            aborted.add(victim)
        if steps % 50 == 0:
            gc.collect()
            rss.append(_rss_bytes())
    assert completed | aborted == {f"s{i}" for i in range(num_requests)} and not completed & aborted
    usage = engine.block_manager.usage()
    assert usage.gpu_used == 0 and usage.cpu_used == 0
    counters = engine.scheduler.counters
    assert counters.preemptions_recompute + counters.preemptions_swap > 0
    if mode == "swap":
        assert counters.preemptions_swap > 0
    assert engine.block_manager.counters.prefix_cache_hits > 0
    assert not engine._beams and not engine._metrics and not engine._num_sent  # no per-request state left
    half = len(rss) // 2
    growth = max(rss[half:]) - rss[half]
    print(f"soak {mode}: {steps} steps, RSS {rss[0] >> 20} -> {rss[-1] >> 20} MiB, second-half growth {growth / 2**20:.1f} MiB")
    assert growth <= RSS_TOLERANCE_BYTES, [r >> 20 for r in rss]
