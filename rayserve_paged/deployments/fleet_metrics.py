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
"""

from __future__ import annotations

import asyncio
import logging

import ray

from rayserve_paged.telemetry import merge_prometheus

logger = logging.getLogger(__name__)

SCHEDULER_NAMESPACE = "rayserve_paged"
SCRAPE_TIMEOUT_S = 5.0


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
