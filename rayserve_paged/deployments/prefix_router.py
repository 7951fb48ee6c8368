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

    MAX_CHOSEN = 10_000  # decisions awaiting on_request_routed
    # a decision not routed within this long is forgotten: its request was cancelled while
    # Serve backed off (a cancellation also forgets it at once), so it holds no phantom load
    CHOSEN_TTL_S = 30.0

    def initialize_state(
        self,
        imbalance_threshold: float = routing.DEFAULT_IMBALANCE_THRESHOLD,
        max_sessions: int = routing.MAX_SESSIONS,
        sent_generation_s: float = routing.SENT_GENERATION_S,
    ) -> None:
        self.policy = routing.AffinityPolicy(imbalance_threshold, max_sessions, sent_generation_s)
        self.clock = time.monotonic
        # internal request id -> (replica, reason, when chosen), oldest first
        self._chosen: OrderedDict[str, tuple[str, str, float]] = OrderedDict()
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
        self._expire()  # before the loads count what is chosen
        loads = await self._queue_lens(candidate_replicas)
        if not loads:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for replica_id in loads:
            stats = by_id[replica_id].routing_stats
            self.policy.update_published(
                replica_id,
                stats.get(routing.PREFIX_KEYS_STAT),
                stats.get(routing.ADAPTERS_STAT),
                stats.get(routing.OFFLOAD_KEYS_STAT),
            )
            loads[replica_id] += self._num_chosen[replica_id]
        replica_id, reason = self.policy.choose(key, loads)
        self._remember(pending_request, replica_id, reason)
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

    def _remember(self, pending_request, replica: str, reason: str) -> None:
        request_id = pending_request.metadata.internal_request_id
        if self._forget(request_id) is None:  # first chosen (else: again, after a backoff)
            future = getattr(pending_request, "future", None)
            if future is not None:  # cancelled before it was routed: forgotten at once
                future.add_done_callback(lambda f: f.cancelled() and self._forget(request_id))
        self._chosen[request_id] = (replica, reason, self.clock())
        self._num_chosen[replica] += 1
        self._expire()

    def _expire(self) -> None:
        """Forget the oldest decisions past MAX_CHOSEN or older than CHOSEN_TTL_S (O(1) each)."""
        chosen = self._chosen
        now = self.clock()
        while chosen and (len(chosen) > self.MAX_CHOSEN or now - next(iter(chosen.values()))[2] > self.CHOSEN_TTL_S):
            _, (oldest, _, _) = chosen.popitem(last=False)
            self._num_chosen[oldest] -= 1

    def _forget(self, request_id: str) -> tuple[str, str, float] | None:
        chosen = self._chosen.pop(request_id, None)
        if chosen is not None:
            self._num_chosen[chosen[0]] -= 1
        return chosen

    def update_replicas(self, replicas) -> None:
        """Serve's push of the running replicas, with their latest routing stats: the
        reports are taken here, off the request path."""
        super().update_replicas(replicas)
        self.policy.retain({r.replica_id.unique_id for r in replicas})
        for r in replicas:
            stats = r.routing_stats
            self.policy.update_published(
                r.replica_id.unique_id,
                stats.get(routing.PREFIX_KEYS_STAT),
                stats.get(routing.ADAPTERS_STAT),
                stats.get(routing.OFFLOAD_KEYS_STAT),
            )
