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
