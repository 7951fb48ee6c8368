"""Tier 2 of the prefix cache on a real engine (tiny random model): a device pool far smaller
than the working set of shared prefixes, with a host tier, makes the same greedy tokens as
an engine whose pool holds everything, prefills less than without the tier, and counts its
hits per tier; the block manager's invariants hold after every step."""

from __future__ import annotations

import random

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from rayserve_paged.config import EngineConfig
from rayserve_paged.core import SamplingParams
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.telemetry import ReplicaTelemetry, TelemetryConfig, names

from ..core.invariants import check_block_manager
from ..telemetry.readings import Readings


def _engine(model_dir: str, num_blocks: int, offload_gb: float, preemption_mode: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model_dir,
            max_model_len=160,
            num_gpu_blocks_override=num_blocks,
            swap_space_gb=0.002,
            kv_offload_memory_gb=offload_gb,
            preemption_mode=preemption_mode,
            max_num_batched_tokens=64,  # long prompts prefill in chunks
            max_num_seqs=4,
        )
    )


def _workload(seed: int):
    """Prompts on 5 shared prefixes of 3-5 blocks, asked about in turn, some salted."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 400) for _ in range(16 * rng.randint(3, 5))] for _ in range(5)]
    requests = []
    for i in range(18):
        prompt = rng.choice(prefixes) + [rng.randrange(5, 400) for _ in range(rng.randint(1, 20))]
        salt = "tenant" if rng.random() < 0.25 else None
        params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True, cache_salt=salt)
        requests.append((f"r{i}", prompt, params))
    return requests


def _run(engine: LLMEngine, requests, rng: random.Random, telemetry=None):
    outputs = {}
    pending = list(requests)
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if pending:
                rid, prompt, params = pending.pop(0)
                engine.add_request(rid, None, params, prompt_token_ids=prompt)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
        check_block_manager(engine.block_manager)
    return outputs


@pytest.mark.parametrize("seed,mode", [(0, "recompute"), (1, "swap")])
def test_a_small_pool_with_a_host_tier_makes_the_unbounded_pools_tokens(tiny_paths, seed, mode):
    requests = _workload(seed)
    reference = _run(_engine(tiny_paths["llama"], 200, 0.0, mode), requests, random.Random(seed))
    without = _engine(tiny_paths["llama"], 14, 0.0, mode)
    assert _run(without, requests, random.Random(seed)) == reference
    tiered = _engine(tiny_paths["llama"], 14, 0.01, mode)
    reader = InMemoryMetricReader()
    telemetry = ReplicaTelemetry(tiered, TelemetryConfig(replica="r"), readers=[reader])
    try:
        assert _run(tiered, requests, random.Random(seed)) == reference
        c = tiered.block_manager.counters
        assert c.offloaded_blocks > 0 and c.restored_blocks > 0 and c.offload_hits == 16 * c.restored_blocks
        assert tiered.num_prompt_tokens < without.num_prompt_tokens  # restored, not recomputed
        assert c.prefix_cache_hits + c.offload_hits > without.block_manager.counters.prefix_cache_hits
        readings = Readings.collect(reader)
        assert readings.value(names.PREFIX_CACHE_TIER_HITS, tier="host") == c.offload_hits
        assert readings.value(names.PREFIX_CACHE_TIER_HITS, tier="device") == c.prefix_cache_hits
        assert readings.value(names.PREFIX_CACHE_TIER_BLOCKS, tier="host", event="restored") == c.restored_blocks
        assert readings.value(names.PREFIX_CACHE_TIER_BLOCKS, tier="host", event="offloaded") == c.offloaded_blocks
        assert readings.value(names.PREFIX_CACHE_TIER_BLOCKS, tier="device", event="evicted") > 0
    finally:
        telemetry.shutdown()


def test_a_tier_without_the_prefix_cache_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="kv_offload_memory_gb: tier 2 of the prefix cache needs enable_prefix_caching"):
        EngineConfig(model="tiny-opt", kv_offload_memory_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_memory_gb"):
        EngineConfig(model="tiny-opt", kv_offload_memory_gb=-1)
