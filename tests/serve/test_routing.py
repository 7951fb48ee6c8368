"""Fleet routing on the session cluster: two CPU replicas of a tiny model, multi-turn chats
with shared system prompts sent as token ids over HTTP (prompts of whole 16-token blocks,
so every expected cache hit is exact):

- routing: load (the one-hop app, Serve's queue-length routing) hits fewer than prefix;
- routing: prefix: every turn after the first finds its whole previous prompt cached on
  its replica, and the replicas' own prefix-cache counters add up to exactly the hits the
  responses report;
- a replica more loaded than the other by more than routing_imbalance_threshold loses a
  request whose prefix it holds; within the threshold it keeps it (and its session's);
- a replica taken away mid-run: its sessions move to the other replica and finish there;
- LoRA adapters (one device slot per replica): each adapter's requests go to the replica
  holding it; past the threshold a hot adapter's request goes to the other replica, which
  loads it.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rayserve_paged.deployments.routing import ADAPTER, IMBALANCE, LOAD, PREFIX, SESSION

from .test_fleet import _app_running, _deploy_config, _replica_states, _schedulers, _wait_for
from .test_handles import TINY, lora_modules  # noqa: F401 (a fixture)

pytestmark = pytest.mark.ray

BLOCK = 16
NUM_SYSTEMS, USERS_PER_SYSTEM = 2, 4
ARGS = TINY | {
    "max_model_len": 2048, "enable_prompt_tokens_details": True, "metrics_cache_s": 0,
    "routing_imbalance_threshold": 2, "routing_stats_period_s": 0.5, "graceful_shutdown_wait_loop_s": 0.5,
    "max_queue_wait_s": 3600,
}  # fmt: skip
# max_queue_wait_s: the imbalance test's hog streams (4 x 1990 tokens each) queue behind each other
# on a replica whose drain rate was measured from one short request; shedding is not under test here
PARAMS = {"max_tokens": 2, "temperature": 0.0}


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


SYSTEMS = [_tokens(s, 2 * BLOCK) for s in range(NUM_SYSTEMS)]
USERS = [(f"user-{s}-{u}", s) for s in range(NUM_SYSTEMS) for u in range(USERS_PER_SYSTEM)]


def _prompt(user: int, turn: int) -> list[int]:
    """A conversation's prompt at `turn` (1-based): its system prompt, then one block per turn."""
    _, system = USERS[user]
    return SYSTEMS[system] + [t for k in range(1, turn + 1) for t in _tokens(1000 * (user + 1) + k, BLOCK)]


def _scrape(port: int) -> dict[str, list]:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60)
    assert response.status_code == 200
    families = text_string_to_metric_families(response.text)
    return {f.name: [s for s in f.samples if s.name.endswith("_total")] for f in families}


def _family(families: dict, suffix: str) -> list:
    (name,) = [n for n in families if n.endswith(suffix)]
    return families[name]


def _hits_by_replica(port: int) -> dict[str, float]:
    return {s.labels["replica"]: s.value for s in _family(_scrape(port), "prefix_cache_hits")}


def _decisions(port: int) -> Counter:
    families = _scrape(port)
    samples = families.get("rayserve_paged_routing_decisions", [])
    return Counter({(s.labels["reason"], s.labels["replica"]): s.value for s in samples})


def _complete(port: int, user: int, prompt: list[int], **extra) -> int:
    """POST /v1/completions as `user` (half send x-session-id, half the `user` field); the
    response's cached prompt tokens."""
    name, _ = USERS[user] if user >= 0 else ("", 0)
    body = {"model": "tiny-llama", "prompt": prompt, **PARAMS, **extra}
    headers = {}
    if user >= 0 and user % 2:
        headers["x-session-id"] = name
    elif user >= 0:
        body["user"] = name
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _chat_turns(port: int, turns: range, with_decisions: bool) -> dict[tuple[int, int], tuple[int, tuple | None]]:
    """Each user's turns, one request at a time: (user, turn) -> (cached tokens, the routing
    decision (reason, replica) it made, when asked)."""
    results = {}
    for turn in turns:
        for user in range(len(USERS)):
            before = _decisions(port) if with_decisions else None
            cached = _complete(port, user, _prompt(user, turn))
            decision = None
            if with_decisions:
                (decision,) = (_decisions(port) - before).keys()
            results[(user, turn)] = (cached, decision)
    return results


def _deploy(serve, name: str, routing: str, **args) -> None:
    _deploy_config(ARGS | args | {"routing": routing}, num_replicas=2, name=name)

    def running() -> bool:
        app = serve.status().applications.get(name)
        assert app is None or app.status != "DEPLOY_FAILED", app.message
        return _app_running(serve, name) and _replica_states(serve, name) == {"RUNNING": 2}

    _wait_for(running, 300, "2 replicas")


class _Routed:
    """The file's one app, "routed" (2 LLMServer replicas), and what was last done to it. Each
    test asks for the state it needs: one already there is used as it is (in the file's order
    each state is made once, by the test before), any other is made again. So every test
    passes in any order, and in the file's order no app is deployed twice."""

    def __init__(self, serve, port: int):
        self.serve, self.port = serve, port
        self.state: str | None = None  # what the deployed app is, and what has run on it
        self.runs: dict[str, dict] = {}  # the runs' results, kept after the app changes

    def deploy(self, routing: str, state: str, **args) -> None:
        """A new app (its caches and counters empty) routed by `routing`."""
        if self.state is not None:
            self.serve.delete("routed")
        self.state = None
        _deploy(self.serve, "routed", routing, **args)
        self.state = state

    def prefix_run(self, live: bool) -> dict:
        """Three turns of every conversation under `routing: load` (its own app), then under
        `routing: prefix`: each turn's cached tokens and routing decision, each replica's
        prefix-cache hits, and the replica each session stuck to. `live`: the prefix-routed
        app of that run still serves, its sessions' blocks where the run left them."""
        if "prefix" not in self.runs or (live and self.state != "prefix run"):
            self.deploy("load", "load run")
            load = _chat_turns(self.port, range(1, 4), with_decisions=False)
            load_hits = sum(_hits_by_replica(self.port).values())
            self.deploy("prefix", "prefix run")
            prefix = _chat_turns(self.port, range(1, 4), with_decisions=True)
            self.runs["prefix"] = {
                "load": load, "load_hits": load_hits, "prefix": prefix, "hits": _hits_by_replica(self.port),
                "sessions": {user: prefix[(user, 1)][1][1] for user in range(len(USERS))},
            }  # fmt: skip
        return self.runs["prefix"]

    def prefix_app(self) -> None:
        """A prefix-routed app with 2 replicas (whatever ran on it)."""
        if self.state not in ("prefix run", "prefix"):
            self.deploy("prefix", "prefix")

    def adapter_run(self, lora_modules: dict) -> dict:
        """Two adapters, one device slot per replica, on a new prefix-routed app: 8 requests
        alternating a0 and a1, each's (adapter, reason, replica) and cached tokens."""
        if self.state != "adapter run":
            lora = {"lora_modules": lora_modules["tiny-llama"], "max_loras": 1, "max_lora_rank": 8}
            self.deploy("prefix", "adapter run", **lora)
            decisions, cached = [], []
            for i in range(8):
                adapter = ("a0", "a1")[i % 2]
                before = _decisions(self.port)
                cached.append(_complete(self.port, -1, _tokens(5000 + i, 2 * BLOCK + 1), model=adapter))
                ((reason, replica),) = (_decisions(self.port) - before).keys()
                decisions.append((adapter, reason, replica))
            first = {adapter: replica for adapter, _, replica in decisions[:2]}
            self.runs["adapters"] = {"decisions": decisions, "cached": cached, "first": first}
        return self.runs["adapters"]


@pytest.fixture(scope="module")
def routed(ray_cluster, serve_port):
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
    app = _Routed(serve, serve_port)
    yield app
    if "routed" in serve.status().applications:  # also after a deploy that failed
        serve.delete("routed")


def test_prefix_routing_hits_every_later_turn_and_load_routing_hits_fewer(routed, serve_port):
    run = routed.prefix_run(live=False)
    load, prefix, hits = run["load"], run["prefix"], run["hits"]
    assert run["load_hits"] == sum(cached for cached, _ in load.values())
    for (user, turn), (cached, decision) in prefix.items():
        if turn > 1:  # the whole previous prompt, on the replica the session stuck to
            assert cached == len(_prompt(user, turn - 1)), (user, turn)
            assert decision == (SESSION, prefix[(user, 1)][1][1]), (user, turn)
    # a system prompt's first user goes to the replica caching fewer blocks, its other users follow
    for system in range(NUM_SYSTEMS):
        first, *others = [u for u, (_, s) in enumerate(USERS) if s == system]
        assert prefix[(first, 1)][0] == 0 and prefix[(first, 1)][1][0] == LOAD
        for user in others:
            assert prefix[(user, 1)] == (len(SYSTEMS[system]), (PREFIX, prefix[(first, 1)][1][1]))
    assert prefix[(0, 1)][1][1] != prefix[(USERS_PER_SYSTEM, 1)][1][1]  # the two systems on two replicas
    assert len(hits) == 2
    for replica, n in hits.items():  # each replica's counter: exactly the hits of the requests routed there
        assert n == sum(cached for cached, decision in prefix.values() if decision[1] == replica), replica
    assert run["load_hits"] < sum(hits.values())


def test_a_replica_past_the_imbalance_threshold_loses_a_prefix_it_holds(routed, serve_port):
    routed.prefix_app()
    replicas = {name.rsplit(":", 1)[1] for name in _schedulers("routed")}
    assert len(replicas) == 2, replicas
    hog = len(USERS)  # a conversation of its own (session "hog", a prefix no one else sends)
    USERS.append(("hog", 0))
    try:
        prefix = _tokens(99, 3 * BLOCK)
        before = _decisions(serve_port)
        _complete(serve_port, hog, prefix + _tokens(100, BLOCK))
        ((_, owner),) = (_decisions(serve_port) - before).keys()
        (other,) = replicas - {owner}

        async def hold(num: int, ready: asyncio.Queue):
            """Stream `num` of the hog session (4 choices of 1990 tokens: seconds on the tiny
            model), read until cancelled."""
            headers = {"x-session-id": "hog"}
            body = {"model": "tiny-llama", "prompt": prefix, "max_tokens": 1990, "n": 4, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            async with httpx.AsyncClient(timeout=120) as client:
                async with client.stream("POST", f"http://127.0.0.1:{serve_port}/v1/completions",
                                         json=body, headers=headers) as response:  # fmt: skip
                    assert response.status_code == 200
                    async for _ in response.aiter_lines():
                        ready.put_nowait(num)

        def routed_to(tail_seed: int) -> tuple[tuple[str, str], int]:
            before = _decisions(serve_port)
            cached = _complete(serve_port, -1, prefix + _tokens(tail_seed, BLOCK))
            (decision,) = (_decisions(serve_port) - before).keys()
            return decision, cached

        async def run():
            ready: asyncio.Queue = asyncio.Queue()
            streams = [asyncio.ensure_future(hold(i, ready)) for i in range(2)]
            await asyncio.wait_for(_started(ready, {0, 1}), 120)
            within = await asyncio.to_thread(routed_to, 101)  # 2 more in its queue: the threshold is 2
            streams.append(asyncio.ensure_future(hold(2, ready)))  # the session's: 2 more is within it
            await asyncio.wait_for(_started(ready, {2}), 120)
            past = await asyncio.to_thread(routed_to, 102)  # 3 more
            (scheduler,) = [a for name, a in _schedulers("routed").items() if name.endswith(owner)]
            num_running = (await scheduler.stats.remote())["num_unfinished_requests"]
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return within, past, num_running

        within, past, num_running = asyncio.run(run())
        assert num_running == 3, "the streams ended before the last request was routed"
        assert within == ((PREFIX, owner), len(prefix))
        assert past == ((IMBALANCE, other), 0)  # sent where its prefix is not cached
    finally:
        USERS.pop()


async def _started(ready: asyncio.Queue, streams: set[int]) -> None:
    """Until each of `streams` has sent an event."""
    seen = set()
    while not streams <= seen:
        seen.add(await ready.get())


def test_a_replica_taken_away_mid_run_its_sessions_move_and_finish(routed, serve_port):
    from ray import serve

    sessions = routed.prefix_run(live=True)["sessions"]
    routed.state = "one replica"
    _deploy_config(ARGS | {"routing": "prefix"}, num_replicas=1, name="routed")
    _wait_for(lambda: _replica_states(serve, "routed") == {"RUNNING": 1}, 120, "one replica left")
    _wait_for(lambda: len(_schedulers("routed")) == 1, 60, "the removed replica's engine to stop")
    (name,) = _schedulers("routed")
    survivor = name.rsplit(":", 1)[1]
    moved = [u for u, r in sessions.items() if r != survivor]
    assert len(moved) == USERS_PER_SYSTEM  # one system's conversations were on the removed replica
    later = _chat_turns(serve_port, range(4, 6), with_decisions=True)
    for user in range(len(USERS)):
        cached, decision = later[(user, 4)]
        if user in moved:  # its blocks went with the replica: only the shared system prompt is found
            assert decision[1] == survivor and decision[0] in (PREFIX, LOAD), user
            assert cached < len(_prompt(user, 3)), user
        else:
            assert (cached, decision) == (len(_prompt(user, 3)), (SESSION, survivor)), user
        assert later[(user, 5)] == (len(_prompt(user, 4)), (SESSION, survivor)), user  # it stuck there


def test_adapter_requests_land_on_the_replica_holding_their_adapter(routed, serve_port, lora_modules):
    """Two adapters, one device slot per replica: each adapter's requests all go to one
    replica (counted by the replicas' own LoRA counters), so no slot is ever reloaded; a
    repeated prompt finds its adapter-keyed chain cached there."""
    run = routed.adapter_run(lora_modules)
    decisions, cached, first = run["decisions"], run["cached"], run["first"]
    assert first["a0"] != first["a1"]  # a1 went where fewer blocks are cached, not onto a0's slot
    assert [(a, r) for a, r, _ in decisions[:2]] == [("a0", LOAD), ("a1", LOAD)]
    assert decisions[2:] == [(a, ADAPTER, first[a]) for a in ("a0", "a1") * 3]
    assert cached == [0] * 8
    before = _decisions(serve_port)
    again = _complete(serve_port, -1, _tokens(5000, 2 * BLOCK + 1), model="a0")  # the first a0 prompt
    assert (again, (_decisions(serve_port) - before)) == (2 * BLOCK, Counter({(PREFIX, first["a0"]): 1}))
    base = _complete(serve_port, -1, _tokens(5000, 2 * BLOCK + 1))  # the base model: another chain
    assert base == 0
    families = _scrape(serve_port)
    requests = {(s.labels["lora_name"], s.labels["replica"]): s.value for s in _family(families, "lora_requests")}
    assert {k: v for k, v in requests.items() if v} == {("a0", first["a0"]): 5, ("a1", first["a1"]): 4}
    loads = {s.labels["replica"]: s.value for s in _family(families, "lora_slot_loads")}
    assert loads == {first["a0"]: 1, first["a1"]: 1}


def test_a_hot_adapter_spreads_to_a_second_replica_past_the_threshold(routed, serve_port, lora_modules):
    """The adapter app (of the test before, in the file's order): a0's replica holds three
    long a0 streams (past routing_imbalance_threshold 2 against the idle replica): the next a0
    request goes to the other replica, which loads a0 into its slot; every request succeeds."""
    first = routed.adapter_run(lora_modules)["first"]
    routed.state = "adapter spread"
    holder, other = first["a0"], first["a1"]

    async def hold(ready: asyncio.Queue):
        body = {"model": "a0", "prompt": _tokens(777, 8), "max_tokens": 1990, "n": 4, "ignore_eos": True,
                "stream": True}  # fmt: skip
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", f"http://127.0.0.1:{serve_port}/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for _ in response.aiter_lines():
                    ready.put_nowait(None)

    def routed_a0() -> tuple[str, str]:
        before = _decisions(serve_port)
        _complete(serve_port, -1, _tokens(778, BLOCK), model="a0")  # asserts 200
        ((decision),) = (_decisions(serve_port) - before).keys()
        return decision

    async def run() -> list[tuple[str, str]]:
        ready: asyncio.Queue = asyncio.Queue()
        streams = []
        decisions = []
        for _ in range(3):  # one at a time: each is routed before the next
            before = await asyncio.to_thread(_decisions, serve_port)
            streams.append(asyncio.ensure_future(hold(ready)))
            await asyncio.wait_for(ready.get(), 120)
            after = await asyncio.to_thread(_decisions, serve_port)
            ((decision),) = (after - before).keys()
            decisions.append(decision)
        decisions.append(await asyncio.to_thread(routed_a0))
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        return decisions

    loads_before = {s.labels["replica"]: s.value for s in _family(_scrape(serve_port), "lora_slot_loads")}
    decisions = asyncio.run(run())
    # a0 stays on its replica until that one is loaded past the threshold (the queue lengths
    # Serve's cache gives the router may be stale by a request or two, so which request moves
    # is not fixed: the threshold's arithmetic is tests/deployments' to pin down);
    # then exactly one request moves it to the other replica, and a0 is held there too
    moved = [i for i, decision in enumerate(decisions) if decision[1] != holder]
    assert moved, decisions
    first = moved[0]
    assert decisions[:first] == [(ADAPTER, holder)] * first, decisions
    assert decisions[first] == (IMBALANCE, other), decisions
    assert all(reason in (ADAPTER, PREFIX, IMBALANCE) for reason, _ in decisions[first + 1:]), decisions
    families = _scrape(serve_port)
    loads = {s.labels["replica"]: s.value for s in _family(families, "lora_slot_loads")}
    assert loads[other] == loads_before[other] + 1 and loads[holder] == loads_before[holder]  # it loaded a0
    requests = {(s.labels["lora_name"], s.labels["replica"]): s.value for s in _family(families, "lora_requests")}
    assert requests[("a0", other)] == sum(1 for _, replica in decisions if replica == other)
