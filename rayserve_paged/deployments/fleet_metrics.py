"""Metrics of every replica in one scrape: GET /metrics merges all LLMServer replicas.

    Prometheus ──GET /metrics──> any replica (through the Serve proxy)
                                   │ list the app's scheduler actors (named, found in the GCS)
                                   ├─> scheduler actor of replica 1 ── metrics_text() ─┐
                                   ├─> scheduler actor of replica 2 ── metrics_text() ─┼─> merge
                                   └─> ...                                             ┘

Each replica's scheduler actor is a named actor (`scheduler_actor_name`) in the
`rayserve_paged` namespace, owned by its replica: it dies with it, so the list is the
live fleet. Every series already carries a `replica` label (and `tp_rank` for the
per-rank figures), so the merge never mixes two replicas. A replica that does not answer
within the timeout is left out of that scrape (its series go stale, as with a failed
scrape) and the rest are still served. docs/TELEMETRY.md says why this path was chosen.

/metrics is open by default (like vLLM's), so its cost must not grow with how often anyone
calls it: each replica keeps the merged text for `metrics_cache_s` (FleetMetricsCache), and
concurrent scrapes share one refresh. One actor listing and one call per scheduler per
interval, however many scrapes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import ray

from rayserve_paged.telemetry import merge_prometheus

logger = logging.getLogger(__name__)

SCHEDULER_NAMESPACE = "rayserve_paged"
SCRAPE_TIMEOUT_S = 5.0
METRICS_CACHE_S = 2.0  # how long a replica serves the same merged fleet text

T = TypeVar("T")


def scheduler_actor_name(app_name: str, replica_id: str) -> str:
    return f"{_prefix(app_name)}{replica_id}"


def _prefix(app_name: str) -> str:
    return f"scheduler:{app_name}:"


def fleet_scheduler_names(app_name: str) -> list[str]:
    """Names of the live scheduler actors of `app_name`'s replicas (a GCS query)."""
    prefix = _prefix(app_name)
    actors = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in actors if a["namespace"] == SCHEDULER_NAMESPACE and a["name"].startswith(prefix))


async def fleet_metrics_text(app_name: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> str:
    """The merged Prometheus text of every replica of `app_name`."""
    names = await asyncio.to_thread(fleet_scheduler_names, app_name)
    texts = await asyncio.gather(*(_metrics_text(name, timeout_s) for name in names))
    return merge_prometheus(t for t in texts if t)


async def _metrics_text(name: str, timeout_s: float) -> str | None:
    try:
        actor = ray.get_actor(name, namespace=SCHEDULER_NAMESPACE)
        return await asyncio.wait_for(actor.metrics_text.remote(), timeout_s)
    except Exception as e:  # stopped between the listing and the call, or too slow: skip it
        logger.warning("metrics of %s left out of this scrape: %s: %s", name, type(e).__name__, e)
        return None


class CachedFetch(Generic[T]):
    """`fetch()`'s value, fetched at most once per `ttl_s`: a call within the interval gets
    the last value; calls that arrive during a refresh await that one refresh (a failed
    refresh is not kept: the next call tries again)."""

    def __init__(
        self, fetch: Callable[[], Awaitable[T]], ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self._fetch = fetch
        self._clock = clock
        self._value: T | None = None
        self._fetched_at: float | None = None  # None: nothing fetched yet
        self._refresh: asyncio.Future | None = None

    async def get(self) -> T:
        if self._fetched_at is not None and self._clock() - self._fetched_at < self.ttl_s:
            return self._value  # type: ignore[return-value]
        if self._refresh is None:
            self._refresh = asyncio.ensure_future(self._fetch_now())
        return await asyncio.shield(self._refresh)  # a caller that leaves does not cancel it

    async def _fetch_now(self) -> T:
        try:
            value = await self._fetch()
            self._value, self._fetched_at = value, self._clock()
            return value
        finally:
            self._refresh = None


class FleetMetricsCache(CachedFetch[str]):
    """The merged fleet text of `app_name`, fetched at most once per `ttl_s` (CachedFetch)."""

    def __init__(
        self,
        app_name: str,
        ttl_s: float = METRICS_CACHE_S,
        fetch: Callable[[str], Awaitable[str]] = fleet_metrics_text,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(lambda: fetch(app_name), ttl_s, clock)
        self.app_name = app_name

    async def text(self) -> str:
        return await self.get()
