"""KVPressurePolicy on recorded replica states (Serve's own AutoscalingContext and
AutoscalingConfig, no cluster), and the stats a replica reports."""

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from rayserve_paged.deployments.autoscaling import (
    KV_USAGE,
    NUM_SWAPPED,
    NUM_WAITING,
    PREEMPTIONS_PER_S,
    EnginePressure,
    KVPressurePolicy,
    PressureReport,
)

DEPLOYMENT = DeploymentID(name="LLMServer", app_name="llm")
REPLICAS = [ReplicaID(f"r{i}", DEPLOYMENT) for i in range(4)]
CONFIG = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=64)


def context(states: list[dict | None], ongoing: float = 0.0, target: int | None = None) -> AutoscalingContext:
    """One running replica per state; None = a replica that has not reported yet. `target`:
    the current decision (more than the running replicas while some start)."""
    running = REPLICAS[: len(states)]
    metrics: dict[str, dict] = {}
    for replica, state in zip(running, states):
        for key, value in (state or {}).items():
            metrics.setdefault(key, {})[replica] = value
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name="LLMServer", app_name="llm",
        current_num_replicas=len(running), target_num_replicas=target or len(running), running_replicas=running,
        total_num_requests=ongoing, total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=CONFIG,
    )  # fmt: skip


def state(usage: float, waiting: int = 0, swapped: int = 0, preemptions_per_s: float = 0.0) -> dict[str, float]:
    return {KV_USAGE: usage, NUM_WAITING: waiting, NUM_SWAPPED: swapped, PREEMPTIONS_PER_S: preemptions_per_s}


POLICY = KVPressurePolicy(target_kv_usage=0.8, scale_down_kv_usage=0.3)


@pytest.mark.parametrize(
    "states, ongoing, desired",
    [
        # 8 long requests (far below 64 ongoing per replica) fill the one cache: scale out
        ([state(0.95)], 8, 2),
        # usage under the target, but requests wait for blocks: scale out
        ([state(0.7, waiting=3)], 8, 2),
        # swapped out, or preempting: the cache is too small for the load
        ([state(0.6, swapped=1)], 4, 2),
        ([state(0.6, preemptions_per_s=0.5)], 4, 2),
        # two replicas nearly full: one more at least, more when the mean says so
        ([state(0.9), state(0.9)], 20, 3),
        ([state(1.0), state(1.0), state(1.0)], 30, 4),
        # comfortable: between the two thresholds nothing moves (hysteresis)
        ([state(0.5), state(0.5)], 10, 2),
        # idle: back down, as far as the remaining usage stays under the target
        ([state(0.1), state(0.0)], 1, 1),
        ([state(0.2), state(0.2), state(0.2), state(0.2)], 4, 1),
        ([state(0.25), state(0.25), state(0.25), state(0.25)], 4, 2),
        # low usage but someone waits (e.g. a prompt too long to admit yet): no scale-down
        ([state(0.1, waiting=1), state(0.1)], 3, 3),
        # request counts still bound it: 200 ongoing at target 64 wants 4 replicas even with a cold cache
        ([state(0.1)], 200, 200 / 64),
        # a replica that has not reported yet is left out of the mean
        ([state(0.95), None], 8, 3),
    ],
)
def test_policy_on_recorded_states(states, ongoing, desired):
    assert POLICY(context(states, ongoing)) == (desired, {})


def test_a_replica_still_starting_is_kept_while_usage_is_in_between():
    """Scaled to 2, one replica still starting: the running one is comfortable, not idle, so
    the target stays 2 (returning the running count would cancel the start-up)."""
    assert POLICY(context([state(0.5)], ongoing=4, target=2)) == (2, {})
    assert POLICY(context([state(0.9)], ongoing=4, target=2)) == (2, {})  # pressure: 2 wanted anyway
    assert POLICY(context([state(0.1)], ongoing=1, target=2)) == (1, {})  # idle: give it up


def test_before_any_report_only_requests_decide():
    assert POLICY(context([None], ongoing=130)) == (130 / 64, {})
    assert POLICY(context([None, None], ongoing=0)) == (0.0, {})


def test_default_thresholds_and_bad_ones():
    policy = KVPressurePolicy()
    assert (policy.target_kv_usage, policy.scale_down_kv_usage) == (0.85, 0.425)
    assert policy(context([state(0.86)]))[0] == 2 and policy(context([state(0.84)]))[0] == 1
    with pytest.raises(ValueError, match="target_kv_usage"):
        KVPressurePolicy(target_kv_usage=0)
    with pytest.raises(ValueError, match="scale_down_kv_usage"):
        KVPressurePolicy(target_kv_usage=0.5, scale_down_kv_usage=0.5)


def test_serve_applies_bounds_and_delays_around_the_policy():
    """Through Serve's own wrapper: max_replicas caps the KV rule, upscale_delay_s holds it."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    wrapped = _apply_autoscaling_config(POLICY)
    ctx = context([state(1.0), state(1.0), state(1.0)], 30)
    ctx.config = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0, target_ongoing_requests=64)
    assert wrapped(ctx)[0] == 4
    ctx = context([state(1.0)], 8)
    ctx.config = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=3600, target_ongoing_requests=64)
    assert wrapped(ctx)[0] == 1  # wants 2, but not for long enough yet


def test_pressure_report_turns_preemption_counts_into_a_rate():
    report = PressureReport()
    first = report.stats(EnginePressure(0.5, 2, 1, num_preemptions=10, time_s=100.0))
    assert first == {KV_USAGE: 0.5, NUM_WAITING: 2.0, NUM_SWAPPED: 1.0, PREEMPTIONS_PER_S: 0.0}
    second = report.stats(EnginePressure.from_dict(
        {"kv_usage": 0.9, "num_waiting": 0, "num_swapped": 0, "num_preemptions": 16}, time_s=104.0
    ))  # fmt: skip
    assert second == {KV_USAGE: 0.9, NUM_WAITING: 0.0, NUM_SWAPPED: 0.0, PREEMPTIONS_PER_S: 1.5}
    assert all(isinstance(v, float) for v in second.values())  # what Serve accepts: int or float values
