"""The statistics every benchmark reports with: one percentile (linear interpolation
between closest ranks, numpy's default), latency summaries and medians of timings."""

from __future__ import annotations

import math
import statistics


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(values: list[float]) -> dict[str, float | None]:
    """{"mean", "median", "p99"} of the values (all None when there are none)."""
    if not values:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": sum(values) / len(values), "median": percentile(values, 50), "p99": percentile(values, 99)}


def median_us(values_ns: list[int]) -> float:
    """The median of nanosecond timings, in microseconds to 0.1."""
    return round(statistics.median(values_ns) / 1000, 1)
