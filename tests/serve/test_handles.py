"""LLMServer through Serve handles: concurrent generate / generate_stream, TP=2 = TP=1,
errors, and the placement of each replica's actors."""

from __future__ import annotations

import asyncio

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


def test_tensor_parallel_2_equals_1_through_serve(serve_session):
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    tp1 = _deploy(serve_session, "tp1")
    expected = [tp1.generate.remote(p, greedy).result().outputs[0].token_ids for p in PROMPTS]
    serve_session.delete("tp1")
    tp2 = _deploy(serve_session, "tp2", tensor_parallel_size=2, worker_cpus=0.3)
    got = [tp2.generate.remote(p, greedy).result().outputs[0].token_ids for p in PROMPTS]
    assert got == expected
    info = tp2.model_info.remote().result()
    assert info["max_model_len"] == 256
