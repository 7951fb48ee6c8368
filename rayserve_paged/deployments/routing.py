"""Fleet routing (`routing: prefix`): each request goes to the replica whose prefix cache
already holds the longest chain of its first blocks, or to its session's replica.

    HTTP ─> Serve proxy ─> OpenAIIngress replica (deployments/ingress.py)
                              │ parse, validate, tokenize; RoutingKey = the prompt's
                              │ prefix_block_keys + the session (x-session-id / `user`)
                              ▼ handle.generate(..., routing=key)
                           PrefixAffinityRouter (prefix_router.py: a Serve RequestRouter in
                              │ the ingress process, running AffinityPolicy below)
                              │ session ─> its replica, while that replica is in the fleet;
                              │ else (a LoRA request) the longest chain among the replicas
                              │ holding its adapter; else the longest cached chain; the
                              │ shortest queue instead when that replica's queue is longer than the shortest
                              │ by more than imbalance_threshold
                              ▼
                           LLMServer replica  ── record_routing_stats(): cached keys, adapters ──┐
                                                                                                 │
                           Serve controller ── polls every routing_stats_period_s, pushes ───────┘
                                               them to every router (RunningReplica.routing_stats)

Why an ingress: with the one-hop app (the OpenAI app inside LLMServer) the proxy's router
sees only Serve's pickled ASGI scope (headers, no body: the replica pulls the body from
the proxy after it is chosen), so neither the prompt nor `user` exists where the
decision is made. Ray Serve LLM's PrefixCacheAffinityRouter reads a parsed request's
`prompt` / `messages` from the handle call's arguments for the same reason, and is not
reused here: it matches characters in a prefix tree of what it *routed* (kept in a
detached actor, one remote call per request), while a replica's cache holds token blocks
under the chat template, evicts them, and is keyed by cache_salt. Here the replicas
publish the keys they really hold, and the router matches token-block keys locally (no
remote call on the request path).

What the router knows of a replica's cache is up to one stats period old, so it also
remembers the keys it sent to each replica since that replica's last two reports (a
conversation's next turn, arriving before the report, still finds its replica).

Cost per decision: O(replicas + the request's blocks), whatever the replicas cache. The
tie-break among equal queues reads a count per replica kept as keys are sent and reports
arrive (never a union of sets); the least-loaded replica is found only by the branches
that use it; a report arrives as the replica's own frozenset (built in the replica, and
taken over by reference), so no set of a cache's size is built when a request is routed.
Memory: the sent keys are two generations per replica, turned over at each report, and
also every `sent_generation_s` and at `max_sent_keys` whether or not a report came (a
replica whose reports are missing or stale cannot grow them without bound).

Tier 2 (kv_offload_memory_gb): replicas also report the keys of the blocks their prefix
cache moved to host memory. A replica's credit for a request is its device chain (blocks)
plus TIER2_CREDIT per block of the tier-2 chain that continues it, as the replica's block
manager restores it (after the device chain, tier 2 only): so a tier-2 hit wins over a miss
and loses to a device hit of the same length.

Adapter affinity: a request naming a LoRA adapter carries the adapter's int id in its
RoutingKey (also the root of its prefix chain: prefix_block_keys(..., lora_id=), as the
replica's block manager keys it, so a chain is found only where it was cached under that
adapter). Replicas report the adapters resident in their device slots; the router sends
the request to the replica holding its adapter (the longest chain, then the shortest queue,
among those holding it), and to the least-loaded replica, which loads the adapter, only
when every holder's queue is past the threshold. Ids are the engine's: 1, 2, ... in
`lora_modules` order on every replica and on the ingress (runtime loading is refused under
`routing: prefix`, since a runtime load would change one replica and could number the
adapter differently there).

Why not Serve's model multiplexing (`serve.multiplexed`, `multiplexed_model_id`): it routes
on a model id set per call and loads the model *inside the replica's Python process*
through a decorated loader with an LRU of its own; here adapters live in the engine's
device slots and CPU cache (core/lora.py, models/lora.py), which that LRU would not see,
and the multiplexed id is read by Serve's own router only. This router already reads the
RoutingKey, so the adapter is one more field of it, matched against what the replicas
really hold, and weighed together with the prefix and the session in one rule.
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily

from rayserve_paged.telemetry import render_families

ROUTING_KWARG = "routing"  # the keyword of LLMServer.generate / generate_stream the router reads
PREFIX_KEYS_STAT = "prefix_keys"  # what RoutedLLMServer.record_routing_stats reports: cached keys,
ADAPTERS_STAT = "lora_resident"  # ... and the int ids of the LoRA adapters in its device slots
OFFLOAD_KEYS_STAT = "offload_keys"  # ... and the keys of its prefix cache's tier 2 (host memory)
# What a block in a replica's tier 2 is worth against one in its device cache (1) and a miss
# (0): a hit there skips the block's prefill but pays a host-to-device copy and takes a device
# block again, and the report of it is as stale as the device one (Ray Serve LLM's KV-aware
# router also credits offloaded blocks less).
TIER2_CREDIT = 0.5
ROUTER_PATH = "rayserve_paged.deployments.prefix_router:PrefixAffinityRouter"
DEFAULT_IMBALANCE_THRESHOLD = 8
MAX_SESSIONS = 100_000  # sessions remembered per router (least recently used forgotten first)
SENT_GENERATION_S = 10.0  # the sent keys turn over at least this often, reports or not
MAX_SENT_KEYS = 1 << 16  # keys per sent generation per replica (then it turns over)

# why a request went where it went (the `reason` label of rayserve_paged_routing_decisions)
SESSION = "session"  # its session's replica
PREFIX = "prefix"  # the replica holding the longest chain of its first blocks
IMBALANCE = "imbalance"  # that replica (session's or prefix's) was too loaded: the least-loaded one
LOAD = "load"  # no replica holds any of its blocks (or no key): the least-loaded one
ADAPTER = "adapter"  # a replica holding its LoRA adapter (and none of its blocks)
FALLBACK = "fallback"  # the chosen replica was full: Serve took the next candidate
REASONS = (SESSION, PREFIX, IMBALANCE, LOAD, ADAPTER, FALLBACK)


@dataclass(slots=True, frozen=True)
class RoutingKey:
    """What the router reads of one engine request (small: ints and a string)."""

    prefix_keys: tuple[int, ...]  # prefix_block_keys of the prompt (under its adapter), first block first
    session: str | None = None
    adapter: int = 0  # the LoRA adapter's int id (0: the base model)


@dataclass(slots=True)
class SentKeys:
    """The keys a router sent one replica: since the last turnover (`current`) and in the
    generation before (`previous`), kept disjoint (a key sent again moves to `current`),
    with how many of each the replica's published set lacks: so the keys it is known to
    hold number len(published) + num_new_current + num_new_previous, kept, not counted."""

    started_at: float
    current: set[int] = field(default_factory=set)
    previous: set[int] = field(default_factory=set)
    num_new_current: int = 0
    num_new_previous: int = 0

    def turn_over(self, now: float) -> None:
        """Forget the generation before; the current one becomes it. O(1)."""
        self.previous, self.current = self.current, set()
        self.num_new_previous, self.num_new_current = self.num_new_current, 0
        self.started_at = now

    def add(self, keys, published: frozenset[int]) -> None:
        current, previous = self.current, self.previous
        for key in keys:
            if key in current:
                continue
            is_new = key not in published
            if key in previous:
                previous.discard(key)
                self.num_new_previous -= is_new
            current.add(key)
            self.num_new_current += is_new

    def __contains__(self, key: int) -> bool:
        return key in self.current or key in self.previous


class AffinityPolicy:
    """The routing rule, over replica ids (strings) and their queue lengths; no Ray.

    State: each replica's published cached keys and resident adapters (replaced at each
    report), the keys and adapters this router sent it since (two generations, turned over
    at each report; the keys also by time and size), and a bounded session -> replica map."""

    def __init__(
        self,
        imbalance_threshold: float = DEFAULT_IMBALANCE_THRESHOLD,
        max_sessions: int = MAX_SESSIONS,
        sent_generation_s: float = SENT_GENERATION_S,
        max_sent_keys: int = MAX_SENT_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0 (got {imbalance_threshold})")
        self.imbalance_threshold = imbalance_threshold
        self.max_sessions = max_sessions
        self.sent_generation_s = sent_generation_s
        self.max_sent_keys = max_sent_keys
        self.clock = clock
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self._published: dict[str, tuple[object, frozenset[int]]] = {}  # replica -> (report, its keys)
        self._sent: dict[str, SentKeys] = {}  # replica -> the keys sent it (two generations)
        self._adapters: dict[str, frozenset[int]] = {}  # replica -> adapter ids resident at its report
        self._sent_adapters: dict[str, tuple[set[int], set[int]]] = {}  # as _sent, for adapter ids
        self._offloaded: dict[str, frozenset[int]] = {}  # replica -> its tier-2 keys at its report

    def update_published(self, replica: str, keys, adapters=None, offload_keys=None) -> None:
        """The replica's latest report (`keys`: a list of ints; `adapters`: its resident
        adapter ids; `offload_keys`: its tier-2 keys); a new `keys` object replaces the old
        sets and turns the sent generations over."""
        if keys is None:
            return
        last = self._published.get(replica)
        if last is not None and last[0] is keys:
            return
        published = keys if isinstance(keys, frozenset) else frozenset(keys)  # a replica reports a frozenset
        self._published[replica] = (keys, published)
        self._adapters[replica] = frozenset(adapters or ())
        self._offloaded[replica] = offload_keys if isinstance(offload_keys, frozenset) else frozenset(offload_keys or ())
        sent = self._sent.get(replica)
        if sent is not None:
            sent.turn_over(self.clock())
            # once per report, O(keys sent in a generation): what the new report lacks
            sent.num_new_previous = sum(1 for key in sent.previous if key not in published)
        current, _ = self._sent_adapters.get(replica, (set(), set()))
        self._sent_adapters[replica] = (set(), current)

    def retain(self, replicas: set[str]) -> None:
        """Forget what is known of every replica not in `replicas` (gone from the fleet)."""
        for replica in (self._published.keys() | self._sent.keys() | self._sent_adapters.keys()) - replicas:
            for state in (self._published, self._sent, self._adapters, self._sent_adapters, self._offloaded):
                state.pop(replica, None)

    def holds_adapter(self, replica: str, adapter: int) -> bool:
        """Whether the replica reported `adapter` resident, or was just sent a request for it."""
        current, previous = self._sent_adapters.get(replica, (set(), set()))
        return adapter in self._adapters.get(replica, ()) or adapter in current or adapter in previous

    def num_cached_blocks(self, replica: str, prefix_keys: tuple[int, ...]) -> int:
        """Leading blocks of the request this replica holds (or was just sent)."""
        published = self._published.get(replica, (None, _EMPTY))[1]
        sent = self._sent_to(replica)
        n = 0
        for key in prefix_keys:
            if key not in published and (sent is None or key not in sent):
                break
            n += 1
        return n

    def prefix_credit(self, replica: str, prefix_keys: tuple[int, ...]) -> float:
        """The replica's device chain for the request, plus TIER2_CREDIT per block of the
        tier-2 chain that continues it."""
        n = self.num_cached_blocks(replica, prefix_keys)
        offloaded = self._offloaded.get(replica)
        if not offloaded:
            return n
        m = 0
        for key in prefix_keys[n:]:
            if key not in offloaded:
                break
            m += 1
        return n + TIER2_CREDIT * m

    def _sent_to(self, replica: str) -> SentKeys | None:
        """The keys sent to `replica`, turned over first when their generation is past due."""
        sent = self._sent.get(replica)
        if sent is not None:
            now = self.clock()
            age = now - sent.started_at
            if age >= self.sent_generation_s:
                sent.turn_over(now)
                if age >= 2 * self.sent_generation_s:  # silent for two generations: both are gone
                    sent.turn_over(now)
        return sent

    def choose(self, key: RoutingKey, loads: dict[str, float]) -> tuple[str, str]:
        """(replica, reason) for `key` among `loads` (replica -> queue length; not empty):
        its session's replica; else, for an adapter some replica holds, the longest chain
        and then the shortest queue among the holders within the threshold; else the
        longest chain anywhere; the shortest queue when the rule's replica is past the
        threshold, or nothing matches."""
        lowest = min(loads.values())
        least = _Once(lambda: self._least_loaded(loads, lowest))  # only the branches that use it pay
        if key.session is not None:
            replica = self.sessions.get(key.session)
            if replica in loads:
                if loads[replica] - lowest > self.imbalance_threshold:
                    return least(), IMBALANCE  # the session moves (and sticks to its new replica)
                return replica, SESSION
        matched = {r: self.prefix_credit(r, key.prefix_keys) for r in loads}
        if key.adapter:
            holders = [r for r in loads if self.holds_adapter(r, key.adapter)]
            if holders:
                within = [r for r in holders if loads[r] - lowest <= self.imbalance_threshold]
                if not within:
                    return least(), IMBALANCE  # the least-loaded replica loads the adapter
                best = min(within, key=lambda r: (-matched[r], loads[r], r != least()))
                return best, PREFIX if matched[best] else ADAPTER
        longest = max(matched.values())
        if longest == 0:
            return least(), LOAD
        best = min((r for r, n in matched.items() if n == longest), key=lambda r: (loads[r], r != least()))
        if loads[best] - lowest > self.imbalance_threshold:
            return least(), IMBALANCE
        return best, PREFIX

    def _least_loaded(self, loads: dict[str, float], lowest: float) -> str:
        """The shortest queue; among equals the replica known to cache the fewest blocks
        (a new prefix goes where it evicts least), then any."""
        tied = [r for r, load in loads.items() if load == lowest]
        if len(tied) == 1:
            return tied[0]
        sizes = {r: self._num_known_blocks(r) for r in tied}
        fewest = min(sizes.values())
        return random.choice([r for r in tied if sizes[r] == fewest])

    def _num_known_blocks(self, replica: str) -> int:
        """Blocks it reported or was sent since its report before last (the two generations
        num_cached_blocks counts: a report taken before a request's prefill forgets nothing).
        O(1): the counts SentKeys keeps."""
        published = self._published.get(replica, (None, _EMPTY))[1]
        sent = self._sent_to(replica)
        return len(published) + (0 if sent is None else sent.num_new_current + sent.num_new_previous)

    def record(self, key: RoutingKey, replica: str) -> None:
        """`key`'s request went to `replica`: its session sticks there, its blocks will be there."""
        if key.session is not None:
            self.sessions[key.session] = replica
            self.sessions.move_to_end(key.session)
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        sent = self._sent_to(replica)
        if sent is None:
            sent = self._sent[replica] = SentKeys(self.clock())
        sent.add(key.prefix_keys, self._published.get(replica, (None, _EMPTY))[1])
        if len(sent.current) >= self.max_sent_keys:
            sent.turn_over(self.clock())
        if key.adapter:
            self._sent_adapters.setdefault(replica, (set(), set()))[0].add(key.adapter)


_EMPTY: frozenset[int] = frozenset()


class _Once:
    """A value computed on its first call, then remembered."""

    __slots__ = ("_make", "_value", "_is_made")

    def __init__(self, make: Callable[[], str]) -> None:
        self._make, self._value, self._is_made = make, None, False

    def __call__(self) -> str:
        if not self._is_made:
            self._value, self._is_made = self._make(), True
        return self._value


class RoutingStats:
    """Decisions by reason and replica, and the time the router spent deciding, in this
    process (each ingress replica's routers count into it); rendered on its /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # routers of several handles may share the process
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.num_steps = 0
        self.step_s = 0.0

    def record_decision(self, reason: str, replica: str) -> None:
        with self._lock:
            self.decisions[(reason, replica)] += 1

    def record_step(self, seconds: float) -> None:
        with self._lock:
            self.num_steps += 1
            self.step_s += seconds

    def metrics_text(self, ingress: str) -> str:
        decisions = CounterMetricFamily(
            "rayserve_paged_routing_decisions",
            "Engine requests routed to each LLMServer replica, by the rule that chose it "
            "(session, prefix, imbalance, load, adapter, fallback).",
            labels=["ingress", "reason", "replica"],
        )
        steps = CounterMetricFamily(
            "rayserve_paged_routing_step_seconds",
            "Time the fleet router spent choosing replicas (the request's keys, the rule, queue-length probes).",
            labels=["ingress"],
        )
        count = CounterMetricFamily(
            "rayserve_paged_routing_steps", "Routing decisions timed in routing_step_seconds.", labels=["ingress"]
        )
        with self._lock:
            for (reason, replica), n in sorted(self.decisions.items()):
                decisions.add_metric([ingress, reason, replica], n)
            steps.add_metric([ingress], self.step_s)
            count.add_metric([ingress], self.num_steps)
        return render_families([decisions, steps, count])


ROUTING_STATS = RoutingStats()  # this process's


class RoutableReplicas:
    """How many LLMServer replicas this process's fleet routers can send a request to now:
    each router's `curr_replicas`, the RUNNING replicas Serve pushed to it (a starting
    replica is not among them), read on the request path at no cost (no remote call).

    Routers register themselves (PrefixAffinityRouter.initialize_state), by app; a router
    that is gone is forgotten (weak references)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # routers may run on the handle's own event-loop thread
        self._routers: dict[str, weakref.WeakSet] = {}

    def register(self, app_name: str, router) -> None:
        with self._lock:
            self._routers.setdefault(app_name, weakref.WeakSet()).add(router)

    def num_routable(self, app_name: str) -> int:
        """The most replicas any of `app_name`'s routers here knows of (0 before any router)."""
        with self._lock:
            routers = list(self._routers.get(app_name, ()))
        return max((len(r.curr_replicas) for r in routers), default=0)


ROUTABLE_REPLICAS = RoutableReplicas()  # this process's


def record_decision(reason: str, replica: str) -> None:
    ROUTING_STATS.record_decision(reason, replica)


def record_step(seconds: float) -> None:
    ROUTING_STATS.record_step(seconds)


def routing_key_of(pending_request) -> RoutingKey | None:
    if pending_request is None:
        return None
    key = pending_request.kwargs.get(ROUTING_KWARG)
    return key if isinstance(key, RoutingKey) else None


