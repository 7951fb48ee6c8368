"""Engine metrics over a real LLMEngine run that preempts with swap (InMemoryMetricReader)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from rayserve_paged.core import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from rayserve_paged.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from rayserve_paged.telemetry import HISTOGRAM_BUCKETS_S, EngineMetrics, TelemetryConfig, setup_meter_provider
from rayserve_paged.telemetry import names

from .conftest import MAX_TOKENS, NUM_REQUESTS, REPLICA
from .readings import Readings

LATENCIES = (
    names.REQUEST_TIME_TO_FIRST_TOKEN,
    names.REQUEST_TIME_PER_OUTPUT_TOKEN,
    names.REQUEST_E2E_LATENCY,
    names.REQUEST_QUEUE_TIME,
)


@pytest.fixture
def readings(swap_run) -> Readings:
    return Readings.collect(swap_run.reader)


def test_the_run_preempted_with_swap(swap_run):
    counters = swap_run.engine.scheduler.counters
    assert counters.preemptions_swap > 0 and counters.preemptions_recompute == 0
    assert len(swap_run.finished) == NUM_REQUESTS


def test_preemptions_and_swapped_blocks_equal_the_engine_counters(swap_run, readings):
    sched, blocks = swap_run.engine.scheduler.counters, swap_run.engine.block_manager.counters
    assert readings.value(names.SCHEDULER_PREEMPTIONS, mode="swap") == sched.preemptions_swap
    assert readings.value(names.SCHEDULER_PREEMPTIONS, mode="recompute") == 0
    assert readings.value(names.KV_CACHE_SWAPPED_BLOCKS, direction="out") == blocks.swapped_out_blocks > 0
    assert readings.value(names.KV_CACHE_SWAPPED_BLOCKS, direction="in") == blocks.swapped_in_blocks
    assert blocks.swapped_in_blocks == blocks.swapped_out_blocks  # all came back
    assert readings.value(names.KV_CACHE_COPY_ON_WRITE_BLOCKS) == blocks.copy_on_write_blocks == 0
    assert readings.value(names.PREFIX_CACHE_QUERIES) == blocks.prefix_cache_queries == NUM_REQUESTS * 20
    assert readings.value(names.PREFIX_CACHE_HITS) == blocks.prefix_cache_hits == 0
    for name in (names.SCHEDULER_PREEMPTIONS, names.KV_CACHE_SWAPPED_BLOCKS, names.PREFIX_CACHE_HITS):
        assert readings.kinds[name] == "sum" and readings.monotonic[name]  # counters, not gauges


def test_token_counters_equal_the_engine(swap_run, readings):
    engine = swap_run.engine
    assert readings.value(names.TOKENS, type="prompt") == engine.num_prompt_tokens == NUM_REQUESTS * 20
    assert readings.value(names.TOKENS, type="generation") == engine.num_generation_tokens == NUM_REQUESTS * MAX_TOKENS


def test_kv_usage_rose_during_the_run_and_returns_to_zero(swap_run, readings):
    assert swap_run.max_gpu_blocks_used == 12  # the pool filled up: that is why it preempted
    assert swap_run.max_swapped >= 1
    assert readings.value(names.KV_CACHE_BLOCKS, pool="device", state="used") == 0
    assert readings.value(names.KV_CACHE_BLOCKS, pool="device", state="free") == 12
    assert readings.value(names.KV_CACHE_BLOCKS, pool="device", state="cached") == 0
    assert readings.value(names.KV_CACHE_BLOCKS, pool="cpu", state="used") == 0
    usage = swap_run.engine.block_manager.usage()
    assert readings.value(names.KV_CACHE_BLOCKS, pool="cpu", state="free") == usage.cpu_total
    assert readings.value(names.KV_CACHE_USAGE, pool="device") == 0.0
    assert readings.value(names.KV_CACHE_USAGE, pool="cpu") == 0.0


def test_no_request_counts_as_running_after_the_run(swap_run):
    scheduler = swap_run.engine.scheduler
    # Mid-run a finished group stays in `running` until the next schedule(); after the last
    # request the engine schedules once more (to release the workers' state), so put one
    # back to see that the gauge skips it.
    assert not scheduler.running
    done = Sequence(10_000, [1, 2, 3])
    done.status = SequenceStatus.FINISHED_STOPPED
    scheduler.running.append(SequenceGroup("done", [done], SamplingParams(), 0.0, 10_000))
    try:
        readings = Readings.collect(swap_run.reader)
    finally:
        scheduler.running.clear()
    for state in ("running", "waiting", "swapped"):
        assert readings.value(names.SCHEDULER_REQUESTS, state=state) == 0


def test_one_latency_observation_per_finished_request(swap_run, readings):
    for name in LATENCIES:
        point = readings.point(name, replica=REPLICA)
        assert point.count == NUM_REQUESTS, name
        assert point.explicit_bounds == list(HISTOGRAM_BUCKETS_S[name]), name  # the seconds buckets
    assert readings.value(names.REQUEST_FINISHED, finish_reason="length") == NUM_REQUESTS


def test_latency_sums_match_the_request_metrics(swap_run, readings):
    ms = [o.metrics for o in swap_run.finished]
    expected = {
        names.REQUEST_TIME_TO_FIRST_TOKEN: sum(m.first_token_time - m.arrival_time for m in ms),
        names.REQUEST_E2E_LATENCY: sum(m.finished_time - m.arrival_time for m in ms),
        names.REQUEST_QUEUE_TIME: sum(m.first_scheduled_time - m.arrival_time for m in ms),
        names.REQUEST_TIME_PER_OUTPUT_TOKEN: sum((m.finished_time - m.first_token_time) / (MAX_TOKENS - 1) for m in ms),
    }
    for name, total in expected.items():
        assert readings.point(name).sum == pytest.approx(total), name
    assert readings.point(names.REQUEST_QUEUE_TIME).sum <= readings.point(names.REQUEST_TIME_TO_FIRST_TOKEN).sum


def test_every_point_carries_the_replica(readings):
    engine_points = [(n, p) for n in names.ENGINE_INSTRUMENTS for p in readings.metrics[n]]
    assert engine_points
    assert all(p.attributes[names.REPLICA] == REPLICA for _, p in engine_points)


# ---------------------------------------------------------------------- record_finished alone


class _Counters:
    def __init__(self, **values):
        self.__dict__.update(values)


class _EngineStub:
    """Only what EngineMetrics reads; no model."""

    def __init__(self):
        from rayserve_paged.core.block_manager import BlockCounters, BlockUsage
        from rayserve_paged.core.scheduler import SchedulerCounters

        usage = BlockUsage(16, 10, 0, 0, 10, 4, 0, 4)
        self.block_manager = _Counters(usage=lambda: usage, counters=BlockCounters())
        self.scheduler = _Counters(counters=SchedulerCounters(), running=[], waiting=[], swapped=[])
        self.num_prompt_tokens = self.num_generation_tokens = 0


def _output(request_id, finish, n_tokens, metrics, error=None):
    outputs = [] if finish is None else [CompletionOutput(0, "", list(range(n_tokens)), 0.0, None, finish)]
    return RequestOutput(request_id, None, [1, 2], outputs, True, metrics, error=error)


def test_record_finished_by_reason_and_the_edge_cases():
    reader = InMemoryMetricReader()
    metrics = EngineMetrics(setup_meter_provider(TelemetryConfig(), [reader]), _EngineStub(), "r0")
    timed = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.0)
    metrics.record_finished(_output("a", "stop", 5, timed))
    one_token = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=1.0, finished_time=1.0)
    metrics.record_finished(_output("b", "length", 1, one_token))  # no time per output token
    metrics.record_finished(_output("c", None, 0, RequestMetrics(arrival_time=0.0), error="never fits"))  # ignored
    unfinished = _output("d", "stop", 3, timed)
    unfinished.finished = False
    metrics.record_finished(unfinished)  # not counted
    metrics.record_aborted()

    r = Readings.collect(reader)
    assert r.value(names.REQUEST_FINISHED, finish_reason="stop") == 1
    assert r.value(names.REQUEST_FINISHED, finish_reason="length") == 2  # b, and the ignored c
    assert r.value(names.REQUEST_FINISHED, finish_reason="abort") == 1
    assert r.point(names.REQUEST_TIME_TO_FIRST_TOKEN).count == 2
    assert r.point(names.REQUEST_TIME_TO_FIRST_TOKEN).sum == pytest.approx(1.0 + 1.0)
    assert r.point(names.REQUEST_QUEUE_TIME).sum == pytest.approx(0.5)
    assert r.point(names.REQUEST_E2E_LATENCY).sum == pytest.approx(3.0 + 1.0)
    tpot = r.point(names.REQUEST_TIME_PER_OUTPUT_TOKEN)
    assert (tpot.count, tpot.sum) == (1, pytest.approx(2.0 / 4))


def test_token_slots_and_fragmentation_of_a_live_engine(tiny_opt):
    """4 requests of 20 prompt tokens on 16-token blocks, after one step (all prefilled, one
    token sampled each): 21 tokens in 2 blocks each, so 84 of 128 GPU slots hold a token."""
    from .conftest import add_requests, start_engine

    engine = start_engine(tiny_opt)
    reader = InMemoryMetricReader()
    provider = setup_meter_provider(TelemetryConfig(replica=REPLICA), [reader])
    EngineMetrics(provider, engine, REPLICA)
    add_requests(engine)
    engine.step()
    readings = Readings.collect(reader)
    assert readings.value(names.KV_CACHE_TOKEN_SLOTS, pool="device", state="used") == 84
    assert readings.value(names.KV_CACHE_TOKEN_SLOTS, pool="device", state="allocated") == 128
    assert readings.value(names.KV_CACHE_FRAGMENTATION, pool="device") == pytest.approx(1 - 84 / 128)
    assert readings.value(names.KV_CACHE_SHARED_BLOCKS, pool="device") == 0
    assert readings.value(names.KV_CACHE_TOKEN_SLOTS, pool="cpu", state="allocated") == 0
    assert readings.value(names.KV_CACHE_FRAGMENTATION, pool="cpu") == 0.0
    while engine.has_unfinished_requests():
        engine.step()
    readings = Readings.collect(reader)
    assert readings.value(names.KV_CACHE_TOKEN_SLOTS, pool="device", state="allocated") == 0
    assert readings.value(names.KV_CACHE_FRAGMENTATION, pool="device") == 0.0
