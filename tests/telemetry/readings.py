"""Data points of an OTel collection (InMemoryMetricReader or a decoded OTLP request),
looked up by metric name and attributes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader


@dataclass
class Point:
    attributes: dict[str, Any]
    value: float | None = None  # sums and gauges
    count: int | None = None  # histograms
    sum: float | None = None
    bucket_counts: list[int] = field(default_factory=list)
    explicit_bounds: list[float] = field(default_factory=list)


@dataclass
class Readings:
    metrics: dict[str, list[Point]]
    kinds: dict[str, str]  # name -> "sum" | "gauge" | "histogram"
    monotonic: dict[str, bool]

    @classmethod
    def collect(cls, reader: InMemoryMetricReader) -> Readings:
        metrics, kinds, monotonic = {}, {}, {}
        data = reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    points = []
                    for p in m.data.data_points:
                        if isinstance(p, HistogramDataPoint):
                            points.append(_histogram_point(dict(p.attributes), p))
                        else:
                            points.append(Point(dict(p.attributes), p.value))
                    metrics[m.name] = points
                    kinds[m.name] = type(m.data).__name__.lower()
                    monotonic[m.name] = getattr(m.data, "is_monotonic", False)
        return cls(metrics, kinds, monotonic)

    @classmethod
    def from_otlp(cls, request) -> Readings:
        """From an ExportMetricsServiceRequest."""
        metrics, kinds, monotonic = {}, {}, {}
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    points = []
                    for p in getattr(m, kind).data_points:
                        attrs = {kv.key: _any_value(kv.value) for kv in p.attributes}
                        if kind == "histogram":
                            points.append(_histogram_point(attrs, p))
                        else:
                            points.append(Point(attrs, p.as_int if p.HasField("as_int") else p.as_double))
                    metrics[m.name] = points
                    kinds[m.name] = kind
                    monotonic[m.name] = kind == "sum" and m.sum.is_monotonic
        return cls(metrics, kinds, monotonic)

    def points(self, name: str, **attributes) -> list[Point]:
        return [p for p in self.metrics.get(name, []) if all(p.attributes.get(k) == v for k, v in attributes.items())]

    def point(self, name: str, **attributes) -> Point:
        found = self.points(name, **attributes)
        assert len(found) == 1, f"{name} {attributes}: {len(found)} points in {self.metrics.get(name)}"
        return found[0]

    def value(self, name: str, **attributes) -> float:
        return self.point(name, **attributes).value


def _histogram_point(attributes: dict[str, Any], p) -> Point:
    return Point(attributes, None, p.count, p.sum, list(p.bucket_counts), list(p.explicit_bounds))


def _any_value(value) -> Any:
    return getattr(value, value.WhichOneof("value"))
