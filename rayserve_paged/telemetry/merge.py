"""Merging the Prometheus texts of several replicas into one exposition.

Every replica renders its own registry (`render_prometheus`), each with its own `# HELP` /
`# TYPE` header per family; concatenated, the same family would be declared several times,
which Prometheus rejects. This parses each text, gathers the samples of each family under
one header, and renders the whole once. Series never collide across replicas: every one
carries a `replica` label. A sample repeated with identical labels (e.g. `target_info` of
replicas with the same resource) is kept once.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    """A collector over already-built families (what generate_latest renders)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)


def merge_prometheus(texts: Iterable[str]) -> str:
    """One Prometheus text (format 0.0.4) with every family of `texts`, each declared once."""
    families: dict[str, Metric] = {}
    seen: set[tuple] = set()
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in seen:
                    seen.add(key)
                    merged.samples.append(sample)
    return render_families(list(families.values()))


def render_families(families: list[Metric]) -> str:
    """Prometheus text (format 0.0.4) of already-built metric families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()
