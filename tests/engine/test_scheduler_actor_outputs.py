"""The SchedulerActor's output stream: steps that queued while the stream was busy leave
as one item, in step order, and a failure queued after them still reaches the reader."""

from __future__ import annotations

import asyncio

import pytest

from rayserve_paged.engine.scheduler_actor import SchedulerActor


def _stream_only() -> SchedulerActor:
    """The actor's output half alone (no engine, no step thread)."""
    actor = SchedulerActor.__new__(SchedulerActor)
    actor._loop, actor._batches = None, None
    return actor


def test_queued_steps_leave_together_in_order_and_a_failure_follows():
    async def main():
        actor = _stream_only()
        stream = actor.outputs()
        actor._attach_loop()
        actor._batches.put_nowait(["s1-a", "s1-b"])
        assert await anext(stream) == ["s1-a", "s1-b"]  # one step: as it was
        for batch in (["s2-a"], ["s3-a", "s3-b"], ["s4-a"]):
            actor._batches.put_nowait(batch)
        actor._batches.put_nowait(RuntimeError("the engine failed"))
        assert await anext(stream) == ["s2-a", "s3-a", "s3-b", "s4-a"]
        with pytest.raises(RuntimeError, match="the engine failed"):
            await anext(stream)

    asyncio.run(main())


def test_a_step_pickles_as_constructor_calls_and_back_whole():
    import pickle

    from rayserve_paged.engine.outputs import RequestMetrics, SequenceDelta, StepOutput

    metrics = RequestMetrics(arrival_time=1.5, first_scheduled_time=2.0, first_token_time=2.25, finished_time=3.0,
                             num_preemptions=1)  # fmt: skip
    step = [
        StepOutput("a@0", [SequenceDelta(0, [5, 6], [{5: -0.5}, {6: -0.25}], -0.75, 9)], False, num_cached_tokens=16),
        StepOutput("b@1", [SequenceDelta(1, [7], None, -1.0, 4, "stop", "\n")], True, metrics=metrics),
        StepOutput("c@2", [], True, error="prompt too long"),
    ]
    assert pickle.loads(pickle.dumps(step, protocol=5)) == step
    assert step[1].__reduce__() == (StepOutput, ("b@1", step[1].outputs, True, 0, metrics, None, None, None))


def test_the_engine_is_built_and_stepped_on_the_step_thread(tiny_paths, monkeypatch):
    """Model load, KV profile and every step run on one thread (one OpenMP team in the
    process); an engine that fails to build fails the actor's constructor with its error."""
    import threading

    from rayserve_paged.config import EngineConfig
    from rayserve_paged.core.sequence import SamplingParams
    from rayserve_paged.engine.llm_engine import LLMEngine
    from rayserve_paged.worker.worker import Worker

    threads = {"load": set(), "step": set()}
    load, step = Worker.load_model, LLMEngine.step
    monkeypatch.setattr(Worker, "load_model", lambda self, *a, **k: threads["load"].add(threading.get_ident()) or load(self, *a, **k))
    monkeypatch.setattr(LLMEngine, "step", lambda self: threads["step"].add(threading.get_ident()) or step(self))
    config = EngineConfig(model=tiny_paths["opt"], max_model_len=64, num_gpu_blocks_override=16, swap_space_gb=0.01)
    actor = SchedulerActor(config, executor="in-process")

    async def main():
        stream = actor.outputs()
        await actor.add_request("r", None, [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        while not any(out.finished for out in await anext(stream)):
            pass

    try:
        asyncio.run(main())
    finally:
        actor.shutdown()
    assert threads["load"] == threads["step"] == {actor._thread.ident}
    assert actor._thread.ident != threading.get_ident()
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerActor(config.model_copy(update={"max_model_len": 10**6}), executor="in-process")


def test_the_step_loop_returns_freed_memory_once_each_time_it_goes_idle(tiny_paths, monkeypatch):
    import time

    from rayserve_paged.config import EngineConfig
    from rayserve_paged.core.sequence import SamplingParams
    from rayserve_paged.engine import scheduler_actor

    trims = []
    monkeypatch.setattr(scheduler_actor, "release_freed_memory", lambda: trims.append(time.monotonic()))
    config = EngineConfig(model=tiny_paths["opt"], max_model_len=64, num_gpu_blocks_override=16, swap_space_gb=0.01)
    actor = SchedulerActor(config, executor="in-process")

    async def request(request_id: str) -> None:
        await actor.add_request(request_id, None, [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        while not any(out.finished for out in await anext(stream)):
            pass

    async def main():
        await asyncio.sleep(0.6)  # idle from the start: nothing to return yet
        assert trims == []
        await request("a")
        await asyncio.sleep(1.2)  # idle again: once, not once per wait
        assert len(trims) == 1
        await request("b")
        await asyncio.sleep(0.6)
        assert len(trims) == 2

    stream = actor.outputs()
    try:
        asyncio.run(main())
    finally:
        actor.shutdown()
