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
    assert step[1].__reduce__() == (StepOutput, ("b@1", step[1].outputs, True, 0, metrics, None))
