"""Autoscaling LLMServer on KV-cache pressure (`autoscaling_policy: kv`).

A replica's capacity is its KV blocks, not a request count: a few long-context requests fill
the cache (and then wait or preempt) long before `target_ongoing_requests` says "scale up",
and many short ones leave most of it idle. So each replica reports its engine's pressure to
Serve's autoscaler, and `KVPressurePolicy` decides the replica count from it.

    SchedulerActor.engine_pressure()   cumulative figures (a dict), read at the call
        │
    LLMServer.record_autoscaling_stats()  ── PressureReport.stats() ──> Serve controller
        (Serve calls it every few seconds;                   (averaged per replica over
         preemptions become a rate here)                      look_back_period_s)
                                                                   │
    KVPressurePolicy(ctx) -> desired replicas  <── AutoscalingContext.aggregated_metrics
        then Serve applies upscale/downscale delays, scaling factors, min/max_replicas

The rule, with n running replicas and the per-replica means over the look-back window:

    pressure  = mean kv_usage > target_kv_usage, or any request waits or is swapped out,
                or any replica preempts
    idle      = mean kv_usage < scale_down_kv_usage, nothing waits, nothing swapped, no
                preemption
    kv        = n + 1 (or n * usage / target when that is more)   under pressure
              = max(1, ceil(n * usage / target))                   when idle (usage then
                                                                   stays under target)
              = the current target                                 otherwise (hysteresis:
                                                                   a replica still starting
                                                                   is not given up)
    desired   = max(kv, total ongoing requests / target_ongoing_requests)

Request counts still bound it: many requests scale out even with a cold cache. Before any
replica has reported (start-up), only the request rule applies. This module imports no
ray, no torch: the policy is pickled by value into the Serve controller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# what a replica reports (keys of record_autoscaling_stats)
KV_USAGE = "rayserve_paged_kv_usage"  # GPU pool: used / total blocks
NUM_WAITING = "rayserve_paged_num_waiting"  # requests admitted to nothing yet
NUM_SWAPPED = "rayserve_paged_num_swapped"  # requests swapped out to the CPU pool
PREEMPTIONS_PER_S = "rayserve_paged_preemptions_per_s"  # since the previous report
STAT_KEYS = (KV_USAGE, NUM_WAITING, NUM_SWAPPED, PREEMPTIONS_PER_S)

POLICY_PATH = "rayserve_paged.deployments.autoscaling:KVPressurePolicy"


@dataclass(slots=True)
class EnginePressure:
    """Cumulative figures of one engine at one instant (SchedulerActor.engine_pressure)."""

    kv_usage: float
    num_waiting: int
    num_swapped: int
    num_preemptions: int  # since the engine started
    time_s: float  # monotonic, of the reading

    @classmethod
    def from_dict(cls, d: dict[str, Any], time_s: float) -> EnginePressure:
        return cls(d["kv_usage"], d["num_waiting"], d["num_swapped"], d["num_preemptions"], time_s)


class PressureReport:
    """Turns successive EnginePressure readings into the stats a replica reports (one per
    replica; preemptions become a rate over the time since the previous reading)."""

    def __init__(self) -> None:
        self._last: EnginePressure | None = None

    def stats(self, now: EnginePressure) -> dict[str, float]:
        last, self._last = self._last, now
        rate = 0.0
        if last is not None and now.time_s > last.time_s:
            rate = max(0, now.num_preemptions - last.num_preemptions) / (now.time_s - last.time_s)
        return {
            KV_USAGE: float(now.kv_usage),
            NUM_WAITING: float(now.num_waiting),
            NUM_SWAPPED: float(now.num_swapped),
            PREEMPTIONS_PER_S: rate,
        }


class KVPressurePolicy:
    """Serve custom autoscaling policy (a class: Serve builds it once with `policy_kwargs`
    and calls it with an AutoscalingContext every control-loop tick)."""

    def __init__(self, target_kv_usage: float = 0.85, scale_down_kv_usage: float | None = None) -> None:
        if not 0 < target_kv_usage <= 1:
            raise ValueError(f"target_kv_usage must be in (0, 1] (got {target_kv_usage})")
        if scale_down_kv_usage is None:
            scale_down_kv_usage = target_kv_usage / 2
        if not 0 <= scale_down_kv_usage < target_kv_usage:
            raise ValueError(
                f"scale_down_kv_usage must be in [0, target_kv_usage={target_kv_usage}) (got {scale_down_kv_usage})"
            )
        self.target_kv_usage = target_kv_usage
        self.scale_down_kv_usage = scale_down_kv_usage

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        n = ctx.current_num_replicas
        if n == 0:
            return ctx.target_num_replicas, {}
        by_requests = ctx.total_num_requests / ctx.config.get_target_ongoing_requests()
        pressure = _mean_pressure(ctx.aggregated_metrics or {}, ctx.running_replicas)
        if pressure is None:  # no replica has reported yet: requests alone decide
            return by_requests, {}
        by_kv = self.replicas_for(n, ctx.target_num_replicas, *pressure)
        return max(by_kv, by_requests), {}

    def replicas_for(
        self, n: int, target: int, kv_usage: float, num_queued: float, preemptions_per_s: float
    ) -> int:
        """The KV rule alone: replicas wanted by n running replicas (the current target is
        `target`, more while replicas start) at this mean usage, with this many requests
        waiting or swapped out in all, preempting this often in all."""
        needed = math.ceil(n * kv_usage / self.target_kv_usage - 1e-9)
        if kv_usage > self.target_kv_usage or num_queued > 0 or preemptions_per_s > 0:
            return max(n + 1, needed)
        if kv_usage < self.scale_down_kv_usage:
            return max(1, min(n, needed))
        return max(n, target)


def _mean_pressure(metrics: dict, replicas) -> tuple[float, float, float] | None:
    """(mean kv usage, total waiting + swapped, total preemptions/s) over the running
    replicas that reported; None when none did."""
    usage = metrics.get(KV_USAGE, {})
    reported = [r for r in replicas if r in usage]
    if not reported:
        return None

    def total(key: str) -> float:
        values = metrics.get(key, {})
        return sum(values.get(r, 0.0) for r in reported)

    kv_usage = sum(usage[r] for r in reported) / len(reported)
    return kv_usage, total(NUM_WAITING) + total(NUM_SWAPPED), total(PREEMPTIONS_PER_S)
