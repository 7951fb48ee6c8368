"""PrefixAffinityRouter: the Serve request router of LLMServer under `routing: prefix`
(deployments/routing.py has the rule, the state and the why).

Serve pickles this module by value into every process that routes to LLMServer, so it
holds only the router class: the policy and the process's decision counters are
referenced from routing.py (pickled by reference: one ROUTING_STATS per process, the one
the ingress's /metrics renders).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict

from ray.serve._private.request_router.request_router import RequestRouter

from rayserve_paged.deployments import routing


class PrefixAffinityRouter(RequestRouter):
    """Serve request router of LLMServer under `routing: prefix` (request_router_config;
    kwargs: imbalance_threshold). Requests without a RoutingKey (model_info, metrics)
    go to the shortest queue."""

    MAX_CHOSEN = 10_000  # decisions awaiting on_request_routed (a cancelled request never arrives)

    def initialize_state(
        self, imbalance_threshold: float = routing.DEFAULT_IMBALANCE_THRESHOLD, max_sessions: int = routing.MAX_SESSIONS
    ) -> None:
        self.policy = routing.AffinityPolicy(imbalance_threshold, max_sessions)
        self._chosen: OrderedDict[str, tuple[str, str]] = OrderedDict()  # internal request id -> (replica, reason)
        # requests chosen for a replica and not yet sent: Serve counts a request in a
        # replica's queue only once sent, so a burst routed together would all see the
        # same queues (and the same empty caches) without this
        self._num_chosen: Counter[str] = Counter()
        routing.ROUTABLE_REPLICAS.register(self.app_name, self)  # the ingress reads it (a start in progress)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        key = routing.routing_key_of(pending_request)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: back off, do not spin
        if key is None:
            return [candidate_replicas]
        started = time.perf_counter()
        loads = await self._queue_lens(candidate_replicas)
        if not loads:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for replica_id in loads:
            stats = by_id[replica_id].routing_stats
            self.policy.update_published(
                replica_id, stats.get(routing.PREFIX_KEYS_STAT), stats.get(routing.ADAPTERS_STAT)
            )
            loads[replica_id] += self._num_chosen[replica_id]
        replica_id, reason = self.policy.choose(key, loads)
        self._remember(pending_request.metadata.internal_request_id, replica_id, reason)
        self.policy.record(key, replica_id)  # the next request of the burst sees it there
        rest = sorted((r for r in loads if r != replica_id), key=loads.__getitem__)
        routing.record_step(time.perf_counter() - started)
        return [[by_id[replica_id]], [by_id[r] for r in rest]]

    async def _queue_lens(self, replicas) -> dict[str, float]:
        """Queue length of each replica that answers (Serve's cache, else a probe)."""
        loads: dict[str, float] = {}
        missing = []
        for r in replicas:
            queue_len = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if queue_len is None:
                missing.append(r)
            else:
                loads[r.replica_id.unique_id] = queue_len
        if missing:
            for r, queue_len in await self._probe_queue_lens(missing, 0):
                if queue_len is not None:
                    loads[r.replica_id.unique_id] = queue_len
        return loads

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        key = routing.routing_key_of(pending_request)
        if key is None:
            return
        replica = replica_id.unique_id
        chosen = self._forget(pending_request.metadata.internal_request_id)
        if chosen is not None and chosen[0] == replica:
            routing.record_decision(chosen[1], replica)
        else:  # Serve sent it elsewhere (the chosen replica was full): it is there
            routing.record_decision(routing.FALLBACK, replica)
            self.policy.record(key, replica)

    def _remember(self, request_id: str, replica: str, reason: str) -> None:
        self._forget(request_id)  # chosen again (Serve retries after a backoff)
        self._chosen[request_id] = (replica, reason)
        self._num_chosen[replica] += 1
        while len(self._chosen) > self.MAX_CHOSEN:
            _, (oldest, _) = self._chosen.popitem(last=False)
            self._num_chosen[oldest] -= 1

    def _forget(self, request_id: str) -> tuple[str, str] | None:
        chosen = self._chosen.pop(request_id, None)
        if chosen is not None:
            self._num_chosen[chosen[0]] -= 1
        return chosen

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        self.policy.retain({r.replica_id.unique_id for r in replicas})
