"""LLMServer through Serve handles: concurrent generate / generate_stream, TP=2 = TP=1,
errors, and the placement of each replica's actors."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from rayserve_paged import SamplingParams
from rayserve_paged.app import AppArgs, engine_config_of, llm_server_options

pytestmark = pytest.mark.ray

TINY = dict(
    model="tiny-llama", device="cpu", max_model_len=256, kv_cache_memory_gb=0.05, swap_space_gb=0.01,
    ray_actor_options={"num_cpus": 0.1}, scheduler_cpus=0.1, worker_cpus=0.3,
)  # fmt: skip


def _deploy(serve, name, **overrides):
    from rayserve_paged.deployments.llm_server import LLMServer

    args = AppArgs(**(TINY | overrides))
    app = serve.deployment(LLMServer, **llm_server_options(args)).bind(
        engine_config_of(args).model_dump(), scheduler_cpus=args.scheduler_cpus, worker_cpus=args.worker_cpus
    )
    return serve.run(app, name=name, route_prefix=None)


PROMPTS = ["Hello world", "The quick brown fox jumps over", "a", "Paged attention keeps blocks"]


def test_concurrent_handle_calls_stream_and_not(serve_session):
    handle = _deploy(serve_session, "handles")
    greedy = SamplingParams(temperature=0.0, max_tokens=12)

    async def one_call(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            return await handle.generate.remote(prompt, greedy)
        last, token_ids, text = None, [], ""
        async for last in handle.options(stream=True).generate_stream.remote(prompt, greedy):
            assert last.outputs or last.finished  # deltas: each says what is new
            for out in last.outputs:
                token_ids += out.token_ids
                text += out.text
        last.outputs[0].token_ids, last.outputs[0].text = token_ids, text  # joined: the whole answer
        return last

    async def run():
        return await asyncio.gather(*[one_call(i) for i in range(24)])

    outputs = asyncio.run(run())
    by_prompt = {}
    for i, out in enumerate(outputs):
        assert out.finished
        by_prompt.setdefault(PROMPTS[i % len(PROMPTS)], set()).add(tuple(out.outputs[0].token_ids))
    assert all(len(v) == 1 for v in by_prompt.values())  # streaming and not: the same tokens
    stats = handle.stats.remote().result()
    assert stats["num_unfinished_requests"] == 0 and stats["gpu_blocks_used"] == 0

    # bad input is a clear error, and the replica keeps serving
    with pytest.raises(Exception, match="prompt"):
        handle.generate.remote({"not": "a prompt"}, greedy).result()
    with pytest.raises(Exception, match="temperature"):
        handle.generate.remote("hi", {"temperature": -1.0}).result()
    assert handle.generate.remote("hi", {"temperature": 0.0, "max_tokens": 3}).result().finished


def _alive(class_name: str) -> list[dict]:
    """Live actors of a class, from the GCS (the state API needs the dashboard, off here)."""
    from ray._private import state

    actors = state.actors(actor_state_name="ALIVE").values()
    return [a for a in actors if a.get("ActorClassName", "").endswith(class_name)]


# A pool of 12 blocks for 10 sequences of ~3 blocks each: every executor preempts. A token
# budget of 16 for ten prompts arriving together: their prefills go in chunks.
PRESSURE = dict(max_model_len=128, num_gpu_blocks_override=12, max_num_batched_tokens=16, max_num_seqs=16)


def _pressure_workload():
    """(workload, the greedy params): the first request holds up to 7 of PRESSURE's 12 blocks
    for 100 steps, so the requests behind it overflow the cache however far apart the
    handle's router lets them in (a busy replica answers its queue-length probes late)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    hold = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    samples = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    beams = SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=12)
    # the engine's token bitmasks reach rank 0 through every transport
    constrained = SamplingParams(n=2, temperature=0.8, seed=9, max_tokens=20,
                                 structured_outputs={"regex": "[a-z]{2,4}( [a-z]{2,5})*"})  # fmt: skip
    workload = [("A long answer holds most blocks", hold)]
    workload += [(p, greedy) for p in PROMPTS + ["One more prompt", "And the last one"]] + [
        ("Parallel samples share a prompt", samples),
        ("Beam candidates share blocks", beams),
        ("Constrained to a regex", constrained),
    ]
    return workload, greedy


def _tokens(out) -> list[list[int]]:
    return [list(c.token_ids) for c in out.outputs]


# requests on LoRA adapters beside the others, one device slot for two adapters: the
# adapters' slots and the sharded A / B reach every rank through every transport
LORA_REQUESTS = [("Hello world", "a0"), ("The quick brown fox jumps over", "a1"), ("Paged attention keeps", "a0")]


@pytest.fixture(scope="module")
def lora_modules(ray_cluster, tmp_path_factory):
    """model name -> {adapter name: PEFT dir} for tiny-llama and tiny-opt (random adapters;
    after ray_cluster, so the tiny models are those of the shared cache)."""
    from rayserve_paged.models.tiny import resolve_model
    from tests.peft_adapters import write_adapter

    root = tmp_path_factory.mktemp("serve-lora")
    modules = {}
    for model, arch in (("tiny-llama", "llama"), ("tiny-opt", "opt")):
        base = resolve_model(model)
        modules[model] = {
            "a0": str(write_adapter(base, root / f"{arch}-a0", arch, "all", 8, 16, seed=1)),
            "a1": str(write_adapter(base, root / f"{arch}-a1", arch, "mlp", 4, 8, seed=2)),
        }
    return modules


@pytest.mark.parametrize(
    "overrides",
    [
        dict(preemption_mode="recompute"),  # TP=1: rank 0 inside the scheduler actor
        dict(preemption_mode="swap", tensor_parallel_size=2, worker_transport="compiled_graph"),
        dict(preemption_mode="recompute", tensor_parallel_size=2, worker_transport="actor_calls"),
        dict(preemption_mode="swap", tensor_parallel_size=2, worker_transport="compiled_graph", model="tiny-opt"),
    ],
    ids=["tp1-in-scheduler", "tp2-compiled-graph-swap", "tp2-actor-calls", "tp2-compiled-graph-opt"],
)
def test_executors_equal_the_offline_engine_under_preemption(serve_session, lora_modules, overrides):
    """Greedy, seeded parallel sampling, beam search and LoRA adapters through a replica
    under KV pressure give exactly the offline in-process engine's tokens (itself equal to
    HF's generate, and HF + PeftModel's), for each way the scheduler drives its ranks."""
    from rayserve_paged import LLM

    workload, greedy = _pressure_workload()
    model = overrides.get("model", "tiny-llama")
    lora = dict(lora_modules=lora_modules[model], max_loras=1, max_lora_rank=8)
    offline = LLM(model=model, device="cpu", max_model_len=128, kv_cache_memory_gb=0.05, **lora)
    expected = [_tokens(o) for o in offline.generate(
        [p for p, _ in workload] + [p for p, _ in LORA_REQUESTS], [s for _, s in workload] + [greedy] * len(LORA_REQUESTS),
        lora_request=[None] * len(workload) + [offline.engine.loras[n] for _, n in LORA_REQUESTS], use_tqdm=False,
    )]  # fmt: skip

    handle = _deploy(serve_session, "executors", **(PRESSURE | overrides | lora))

    async def run():
        calls = [handle.generate.remote(p, s) for p, s in workload]
        calls += [handle.generate.remote(p, greedy, lora_name=n) for p, n in LORA_REQUESTS]
        return await asyncio.gather(*calls)

    outputs = asyncio.run(run())
    got = [_tokens(o) for o in outputs]
    assert got == expected
    outputs = outputs[: len(workload)]
    assert all(re.fullmatch("[a-z]{2,4}( [a-z]{2,5})*", c.text) or c.finish_reason == "length"
               for c in outputs[-1].outputs)  # fmt: skip
    tp = overrides.get("tensor_parallel_size", 1)
    assert len(_alive("WorkerActor")) == (0 if tp == 1 else tp)  # TP=1: no worker actor at all
    stats = handle.stats.remote().result()
    assert stats["preemptions_" + overrides["preemption_mode"]] > 0
    assert stats["num_unfinished_requests"] == 0 and stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0
    assert stats["worker_batch_states"] == [(0, 0)] * tp  # no request's state outlives it on any rank
    handle.check_health.remote().result()  # the ranks still answer plain calls beside the step graph
    serve_session.delete("executors")


def test_tier_2_restores_at_tp2_equal_tp1_without_it(serve_session):
    """Prefix-cache tier 2 at TP=2 (compiled graph): documents evicted from a 12-block KV
    cache come back from host memory on every rank's shard, and the greedy answers equal
    those of the offline TP=1 engine with no tier and a cache that holds everything."""
    from rayserve_paged import LLM

    rng = random.Random(3)
    docs = [[rng.randrange(4, 500) for _ in range(64)] for _ in range(3)]  # 4 full blocks each
    prompts = [doc + [rng.randrange(4, 500) for _ in range(8)] for _ in range(2) for doc in docs]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offline = LLM(model="tiny-llama", device="cpu", max_model_len=128, num_gpu_blocks_override=200)
    expected = [_tokens(o) for o in offline.generate(prompts, greedy, use_tqdm=False)]

    handle = _deploy(serve_session, "tier2", max_model_len=128, num_gpu_blocks_override=12, kv_offload_memory_gb=0.01,
                     tensor_parallel_size=2, worker_transport="compiled_graph")  # fmt: skip
    got = [_tokens(handle.generate.remote(p, greedy).result()) for p in prompts]  # one at a time: each evicts
    assert got == expected
    stats = handle.stats.remote().result()
    # each request fills 5 blocks: the third document evicts 3 of the first's, which come back
    # from tier 2 when the first is asked about again
    assert stats["tier2_restored_blocks"] >= 3, stats
    assert stats["tier2_offloaded_blocks"] >= stats["tier2_restored_blocks"], stats
    assert stats["gpu_blocks_used"] == 0 and stats["worker_batch_states"] == [(0, 0)] * 2
    serve_session.delete("tier2")


def test_speculation_at_tp2_equals_tp1_without_it(serve_session):
    """N-gram drafts verified at TP=2 (actor calls, swap preemption) give the greedy tokens
    of the offline TP=1 engine without speculation, and leave nothing on any rank."""
    from rayserve_paged import LLM

    rng = random.Random(38)
    phrases = [[rng.randrange(4, 500) for _ in range(rng.randrange(3, 6))] for _ in range(4)]
    prompts = [phrase * 4 + [rng.randrange(4, 500)] for phrase in phrases]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    offline = LLM(model="tiny-llama", device="cpu", max_model_len=128, num_gpu_blocks_override=200)
    expected = [_tokens(o) for o in offline.generate(prompts, greedy, use_tqdm=False)]

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    handle = _deploy(serve_session, "spec-tp2", **(PRESSURE | dict(preemption_mode="swap", tensor_parallel_size=2,
                     worker_transport="actor_calls", speculative_config=spec)))  # fmt: skip

    async def run():
        return await asyncio.gather(*[handle.generate.remote(p, greedy) for p in prompts])

    assert [_tokens(o) for o in asyncio.run(run())] == expected
    stats = handle.stats.remote().result()
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats  # drafts were verified and kept
    assert stats["num_unfinished_requests"] == 0 and stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0
    assert stats["worker_batch_states"] == [(0, 0)] * 2
    serve_session.delete("spec-tp2")
