"""The fleet routing rule (AffinityPolicy) and its counters, without Ray: exact choices."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rayserve_paged.app import AppArgs
from rayserve_paged.core.block_manager import prefix_block_keys
from rayserve_paged.deployments.openai_ingress import routing_session
from rayserve_paged.deployments.routing import (
    ADAPTER,
    IMBALANCE,
    LOAD,
    PREFIX,
    SESSION,
    AffinityPolicy,
    RoutingKey,
    RoutingStats,
)

SYSTEM = list(range(1000, 1048))  # 3 blocks of 16
CHAT = SYSTEM + list(range(2000, 2040))  # 5 full blocks, 8 tokens more


def key(tokens, session=None) -> RoutingKey:
    return RoutingKey(tuple(prefix_block_keys(tokens, 16)), session)


def test_the_longest_published_chain_wins_and_no_match_goes_to_the_least_loaded():
    policy = AffinityPolicy(imbalance_threshold=4)
    policy.update_published("a", [key(CHAT).prefix_keys[0]])  # the system prompt's first block
    policy.update_published("b", list(key(CHAT).prefix_keys[:4]))
    assert policy.num_cached_blocks("a", key(CHAT).prefix_keys) == 1
    assert policy.num_cached_blocks("b", key(CHAT).prefix_keys) == 4
    assert policy.choose(key(CHAT), {"a": 0, "b": 3}) == ("b", PREFIX)
    assert policy.choose(key(list(range(5000, 5040))), {"a": 2, "b": 1}) == ("b", LOAD)
    # a chain counts from its first block: a later block alone is no match
    policy.update_published("a", list(key(CHAT).prefix_keys[1:]))
    assert policy.num_cached_blocks("a", key(CHAT).prefix_keys) == 0


def test_among_equal_queues_a_new_prefix_goes_to_the_replica_caching_fewest_blocks():
    policy = AffinityPolicy()
    policy.update_published("a", list(key(SYSTEM + [1]).prefix_keys))
    policy.update_published("b", [])
    other = key(list(range(3000, 3040)))
    assert policy.choose(other, {"a": 0, "b": 0}) == ("b", LOAD)
    policy.record(other, "b")  # b now holds 2 blocks (sent), a 3 (published)
    assert policy.choose(key(list(range(4000, 4040))), {"a": 0, "b": 0}) == ("b", LOAD)
    policy.record(key(list(range(4000, 4040))), "b")  # 4 against 3
    assert policy.choose(key(list(range(6000, 6040))), {"a": 0, "b": 0}) == ("a", LOAD)


def test_equal_chains_go_to_the_less_loaded_and_the_threshold_passes_a_loaded_replica_over():
    policy = AffinityPolicy(imbalance_threshold=4)
    system = list(key(SYSTEM + [1]).prefix_keys)
    policy.update_published("a", system)
    policy.update_published("b", system)
    assert policy.choose(key(CHAT), {"a": 3, "b": 1}) == ("b", PREFIX)
    policy.update_published("a", list(key(CHAT).prefix_keys))
    assert policy.choose(key(CHAT), {"a": 5, "b": 1}) == ("a", PREFIX)  # 4 more: within the threshold
    assert policy.choose(key(CHAT), {"a": 6, "b": 1}) == ("b", IMBALANCE)  # 5 more: passed over
    with pytest.raises(ValueError, match="imbalance_threshold"):
        AffinityPolicy(imbalance_threshold=-1)


def test_a_report_taken_before_a_prefill_does_not_make_its_replica_look_empty_to_the_tie_break():
    """a got a new prefix; a's next report was taken before that prefill: among equal queues
    the next new prefix still goes to b (the two-replica LoRA routing test's race)."""
    policy = AffinityPolicy()
    policy.update_published("a", [])
    policy.update_published("b", [])
    first = key(list(range(5000, 5040)))
    assert policy.choose(first, {"a": 0, "b": 0})[1] == LOAD
    policy.record(first, "a")
    policy.update_published("a", [])  # the stale report
    assert policy.choose(key(list(range(6000, 6040))), {"a": 0, "b": 0}) == ("b", LOAD)
    policy.update_published("a", [])  # a second report after it: the prefix is gone from a
    policy.record(key(list(range(7000, 7040))), "b")
    assert policy.choose(key(list(range(8000, 8040))), {"a": 0, "b": 0}) == ("a", LOAD)


def test_keys_sent_to_a_replica_count_until_its_second_report_after_them():
    policy = AffinityPolicy()
    policy.update_published("a", [])
    policy.update_published("b", [])
    policy.record(key(CHAT), "a")  # not yet in a's report
    assert policy.choose(key(CHAT + [7, 8]), {"a": 1, "b": 0}) == ("a", PREFIX)
    policy.update_published("a", [])  # a report taken before the prefill: the keys still count
    assert policy.num_cached_blocks("a", key(CHAT).prefix_keys) == 5
    policy.update_published("a", [])  # the next report says a holds none of them (evicted)
    assert policy.num_cached_blocks("a", key(CHAT).prefix_keys) == 0
    same = []
    policy.update_published("b", same)
    policy.record(key(CHAT), "b")
    policy.update_published("b", same)  # the same report object again: not a new report
    policy.update_published("b", [])
    assert policy.num_cached_blocks("b", key(CHAT).prefix_keys) == 5


def test_a_session_sticks_to_its_replica_while_the_replica_is_in_the_fleet_and_not_overloaded():
    policy = AffinityPolicy(imbalance_threshold=3)
    policy.update_published("b", list(key(CHAT).prefix_keys))
    policy.record(key(SYSTEM, "s1"), "a")
    # the session's replica even against a longer chain elsewhere, within the threshold
    assert policy.choose(key(CHAT, "s1"), {"a": 3, "b": 0}) == ("a", SESSION)
    assert policy.choose(key(CHAT, "s1"), {"a": 4, "b": 0}) == ("b", IMBALANCE)
    # a gone: the session is routed by its prefix and then sticks to the new replica
    assert policy.choose(key(CHAT, "s1"), {"b": 0, "c": 0}) == ("b", PREFIX)
    policy.record(key(CHAT, "s1"), "b")
    policy.retain({"b", "c"})
    assert policy.choose(key(CHAT, "s1"), {"b": 3, "c": 0}) == ("b", SESSION)
    assert policy.num_cached_blocks("a", key(SYSTEM).prefix_keys) == 0  # a's state is forgotten


def test_the_session_map_is_bounded_least_recently_used_first():
    policy = AffinityPolicy(max_sessions=2)
    for session, replica in (("s1", "a"), ("s2", "b"), ("s1", "a"), ("s3", "b")):
        policy.record(key(SYSTEM, session), replica)
    assert list(policy.sessions.items()) == [("s1", "a"), ("s3", "b")]


def test_routing_sessions_are_fixed_size_digests_header_first():
    assert routing_session(None, None) is None
    assert routing_session("", None) is None
    long = "u" * 100_000
    assert len(routing_session(None, long)) == 32
    assert routing_session("h", "u") == routing_session("h", None) != routing_session(None, "u")
    assert routing_session(None, "\ud800") is not None  # a lone surrogate from JSON is still a session


def test_routing_stats_render_decisions_by_reason_and_replica():
    stats = RoutingStats()
    for reason, replica in ((PREFIX, "a"), (PREFIX, "a"), (SESSION, "b"), (LOAD, "a")):
        stats.record_decision(reason, replica)
    stats.record_step(0.25)
    stats.record_step(0.5)
    families = {f.name: f for f in text_string_to_metric_families(stats.metrics_text("i1"))}
    decisions = {
        (s.labels["reason"], s.labels["replica"]): s.value
        for s in families["rayserve_paged_routing_decisions"].samples
        if s.name.endswith("_total")
    }
    assert decisions == {(PREFIX, "a"): 2, (SESSION, "b"): 1, (LOAD, "a"): 1}
    (seconds,) = [s for s in families["rayserve_paged_routing_step_seconds"].samples if s.name.endswith("_total")]
    (steps,) = [s for s in families["rayserve_paged_routing_steps"].samples if s.name.endswith("_total")]
    assert (seconds.value, steps.value, steps.labels) == (0.75, 2, {"ingress": "i1"})


def test_app_args_routing_fields_are_checked():
    assert AppArgs(model="tiny-opt").routing == "load"
    with pytest.raises(ValueError, match="routing"):
        AppArgs(model="tiny-opt", routing="adapter")
    with pytest.raises(ValueError, match="request_router_config"):
        AppArgs(model="tiny-opt", routing="prefix", deployment_options={"request_router_config": {}})
    with pytest.raises(ValueError, match="routing_imbalance_threshold"):
        AppArgs(model="tiny-opt", routing_imbalance_threshold=-1)


class _Call:
    """What DeploymentHandle.method.remote(...) returns, over a coroutine or an async iterator."""

    def __init__(self, result) -> None:
        self._result = result
        self.is_cancelled = False

    def __await__(self):
        return self._result.__await__()

    def __aiter__(self):
        return self._result.__aiter__()

    def cancel(self) -> None:
        self.is_cancelled = True


class _FakeHandle:
    """A DeploymentHandle to LLMServer over the in-process engine client; records each call's RoutingKey."""

    def __init__(self, client) -> None:
        self.client = client
        self.keys: list[RoutingKey] = []
        self.lora_names: list[str | None] = []
        self.generate = self._method(lambda *a, **kw: client.generate(*a, **kw))
        self.generate_stream = self._method(lambda *a, **kw: client.generate_stream(*a, **kw))
        self.model_info = self._method(lambda: client.model_info())

    def _method(self, call):
        handle = self

        class _Method:
            def remote(self, *args, routing=None, lora_name=None):
                if routing is not None:
                    handle.keys.append(routing)
                    handle.lora_names.append(lora_name)
                return _Call(call(*args, **({} if lora_name is None else {"lora_name": lora_name})))

        return _Method()

    def options(self, stream: bool = False):
        return self


@pytest.mark.anyio
async def test_the_ingress_client_sends_each_prompts_keys_and_session_streamed_or_not(engine_client, engine):
    import httpx

    from rayserve_paged.deployments.ingress import RoutedEngineClient
    from rayserve_paged.deployments.openai_ingress import create_openai_app

    handle = _FakeHandle(engine_client)
    app = create_openai_app(RoutedEngineClient(handle, 16, None, "i1"), engine.tokenizer, "tiny-opt")
    prompt = list(range(20, 60))  # 40 tokens: 2 full blocks looked up
    body = {"model": "tiny-opt", "prompt": prompt, "max_tokens": 2, "cache_salt": "t1"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        for extra, headers in (({}, {"x-session-id": "s1"}), ({"stream": True}, {"x-session-id": "s1"}),
                               ({"user": "u1"}, {}), ({"stream": True, "user": "u1"}, {"x-session-id": "s2"}),
                               ({}, {})):  # fmt: skip
            response = await http.post("/v1/completions", json=body | extra, headers=headers)
            assert response.status_code == 200, response.text
    expected = tuple(prefix_block_keys(prompt, 16, "t1"))
    assert [k.prefix_keys for k in handle.keys] == [expected] * 5
    sessions = [routing_session("s1", None)] * 2 + [routing_session(None, "u1"), routing_session("s2", None), None]
    assert [k.session for k in handle.keys] == sessions


def adapter_key(tokens, adapter, session=None) -> RoutingKey:
    return RoutingKey(tuple(prefix_block_keys(tokens, 16, lora_id=adapter)), session, adapter)


def test_an_adapter_request_goes_to_the_replica_holding_its_adapter_until_past_the_threshold():
    policy = AffinityPolicy(imbalance_threshold=2)
    policy.update_published("a", list(key(CHAT).prefix_keys), adapters=[])  # the base model's chain only
    policy.update_published("b", [], adapters=[2])
    policy.update_published("c", [], adapters=[1, 2])
    # the base model's chain on a is no match for adapter 1: its chain is keyed by the adapter
    assert policy.num_cached_blocks("a", adapter_key(CHAT, 1).prefix_keys) == 0
    assert policy.choose(adapter_key(CHAT, 1), {"a": 0, "b": 0, "c": 2}) == ("c", ADAPTER)
    assert policy.choose(adapter_key(CHAT, 1), {"a": 0, "b": 1, "c": 3}) == ("a", IMBALANCE)  # a loads it
    # among holders, the shorter queue; an adapter nobody holds: the base rule (least loaded)
    assert policy.choose(adapter_key(CHAT, 2), {"a": 0, "b": 2, "c": 1}) == ("c", ADAPTER)
    assert policy.choose(adapter_key(CHAT, 3), {"a": 1, "b": 0, "c": 2}) == ("b", LOAD)
    assert policy.choose(key(CHAT), {"a": 2, "b": 0, "c": 0}) == ("a", PREFIX)  # the base model: no adapter rule


def test_adapter_and_prefix_together_the_longest_adapter_chain_among_holders_wins():
    policy = AffinityPolicy(imbalance_threshold=4)
    chain = adapter_key(CHAT, 2).prefix_keys
    assert chain != key(CHAT).prefix_keys and chain == tuple(prefix_block_keys(CHAT, 16, lora_id=2))
    policy.update_published("a", list(chain), adapters=[1])  # the chain, but adapter 2 evicted from its slot
    policy.update_published("b", list(chain[:2]), adapters=[2])
    policy.update_published("c", list(chain[:4]), adapters=[2])
    assert policy.choose(adapter_key(CHAT, 2), {"a": 0, "b": 0, "c": 3}) == ("c", PREFIX)
    assert policy.choose(adapter_key(CHAT, 2), {"a": 0, "b": 0, "c": 5}) == ("b", PREFIX)  # c past the threshold
    # a request sent to a replica makes it a holder until its second report after
    policy.record(adapter_key(SYSTEM, 3), "a")
    assert policy.holds_adapter("a", 3) and not policy.holds_adapter("b", 3)
    assert policy.choose(adapter_key(list(range(7000, 7040)), 3), {"a": 1, "b": 0, "c": 0}) == ("a", ADAPTER)
    report = list(chain)
    policy.update_published("a", report, adapters=[1])
    assert policy.holds_adapter("a", 3)
    policy.update_published("a", report, adapters=[1])  # the same keys object: not a new report
    assert policy.holds_adapter("a", 3)
    policy.update_published("a", [], adapters=[1])
    assert not policy.holds_adapter("a", 3)
    policy.retain({"b"})
    assert not policy.holds_adapter("c", 2)


def test_startup_adapter_ids_follow_lora_modules_order_as_the_engine_numbers_them():
    from rayserve_paged.core.lora import startup_lora_ids

    assert startup_lora_ids({"sql": "/a", "chat": "/b", "code": "/c"}) == {"sql": 1, "chat": 2, "code": 3}
    with pytest.raises(ValueError, match="allow_runtime_lora_updating"):
        AppArgs(model="tiny-opt", routing="prefix", lora_modules={"a": "/x"}, allow_runtime_lora_updating=True)


@pytest.mark.anyio
async def test_the_ingress_client_keys_an_adapter_request_by_its_startup_id(engine_client, engine):
    import httpx

    from rayserve_paged.deployments.ingress import RoutedEngineClient
    from rayserve_paged.deployments.openai_ingress import create_openai_app

    handle = _FakeHandle(engine_client)
    client = RoutedEngineClient(handle, 16, None, "i1", lora_modules={"sql": "/a", "chat": "/b"})
    app = create_openai_app(client, engine.tokenizer, "tiny-opt")
    prompt = list(range(20, 60))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny-opt", "sql", "chat"]
        # the in-process engine holds no adapter: it answers 404, after the key was made
        response = await http.post("/v1/completions", json={"model": "chat", "prompt": prompt, "max_tokens": 1})
        assert response.status_code == 404, response.text
        unknown = await http.post("/v1/completions", json={"model": "nope", "prompt": prompt, "max_tokens": 1})
        assert unknown.status_code == 404 and "'sql'" in unknown.text  # refused by the ingress: no call
    assert handle.keys == [RoutingKey(tuple(prefix_block_keys(prompt, 16, lora_id=2)), None, 2)]
    assert handle.lora_names == ["chat"]


def test_routable_replicas_counts_what_the_routers_here_can_route_to_and_forgets_a_gone_router():
    import gc

    from rayserve_paged.deployments.routing import RoutableReplicas

    class _Router:
        def __init__(self, n: int) -> None:
            self.curr_replicas = {f"r{i}": object() for i in range(n)}

    seen = RoutableReplicas()
    assert seen.num_routable("llm") == 0  # no router yet
    streaming, plain = _Router(0), _Router(0)
    seen.register("llm", streaming)
    seen.register("llm", plain)
    other = _Router(3)
    seen.register("other", other)
    assert seen.num_routable("llm") == 0  # routers, no RUNNING replica pushed to them
    plain.curr_replicas = {"r0": object(), "r1": object()}
    assert seen.num_routable("llm") == 2 and seen.num_routable("other") == 3
    del plain
    gc.collect()
    assert seen.num_routable("llm") == 0


@pytest.mark.parametrize(
    ("states", "starting"),
    [
        ({"STARTING": 1}, True),  # the first replica being placed or loading its model
        ({"STARTING": 2, "STOPPING": 1}, True),  # the last one died, its replacements start
        ({"RUNNING": 1, "STARTING": 1}, False),  # one serves: Serve routes to it
        ({"RUNNING": 1}, False),
        ({}, False),  # scaled to zero: the request goes on and asks the autoscaler for one
        ({"STOPPING": 1}, False),
        (None, False),  # the controller could not say
    ],
)
def test_a_fleet_is_starting_only_with_no_replica_running_and_one_starting(states, starting):
    from rayserve_paged.deployments.ingress import is_starting

    assert is_starting(states) is starting


class _Readiness:
    """FleetReadiness's inputs, settable: the routers' replica count and the controller's states."""

    def __init__(self) -> None:
        self.num_routable = 0
        self.states: dict | None = {"STARTING": 1}
        self.fetches: list[tuple[str, str]] = []

    async def fetch(self, app: str, deployment: str):
        self.fetches.append((app, deployment))
        return self.states

    def readiness(self, ttl_s: float = 60.0):
        from rayserve_paged.deployments.ingress import FleetReadiness

        return FleetReadiness("llm", "LLMServer", ttl_s, self.fetch, lambda app: self.num_routable)


@pytest.mark.anyio
async def test_fleet_readiness_asks_the_controller_only_while_no_replica_is_routable_and_shares_the_answer():
    import asyncio

    from rayserve_paged.deployments.errors import OpenAIError

    inputs = _Readiness()
    readiness = inputs.readiness()
    results = await asyncio.gather(*(readiness.check() for _ in range(10)), return_exceptions=True)
    assert all(isinstance(r, OpenAIError) and r.status_code == 503 for r in results)
    assert results[0].info.code == "engine_starting" and results[0].headers == {"Retry-After": "5"}
    assert inputs.fetches == [("llm", "LLMServer")]  # one controller call for ten requests
    inputs.num_routable = 1  # a replica is RUNNING and its router knows it: no call, no wait
    await readiness.check()
    assert len(inputs.fetches) == 1
    inputs.num_routable, inputs.states = 0, {}  # scaled to zero: not starting, the request goes on
    fresh = inputs.readiness(ttl_s=0.0)
    await fresh.check()
    assert len(inputs.fetches) == 2


@pytest.mark.anyio
async def test_while_the_fleet_starts_the_ingress_answers_503_retry_after_and_serves_once_a_replica_runs(
    engine_client, engine
):
    import httpx

    from rayserve_paged.deployments.ingress import RoutedEngineClient
    from rayserve_paged.deployments.openai_ingress import create_openai_app

    handle = _FakeHandle(engine_client)
    inputs = _Readiness()
    client = RoutedEngineClient(handle, 16, None, "i1", readiness=inputs.readiness(ttl_s=0.0))
    app = create_openai_app(client, engine.tokenizer, "tiny-opt")
    body = {"model": "tiny-opt", "prompt": list(range(20, 60)), "max_tokens": 2}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        for method, path, extra in (("POST", "/v1/completions", {}), ("POST", "/v1/completions", {"stream": True}),
                                    ("GET", "/v1/models", None), ("GET", "/health", None)):  # fmt: skip
            response = await http.request(method, path, json=None if extra is None else body | extra)
            assert response.status_code == 503, (path, response.text)
            assert response.headers["retry-after"] == "5"
            assert response.json()["error"]["code"] == "engine_starting", path
        assert handle.keys == []  # nothing reached the handle (Serve's router would hold it)
        inputs.num_routable = 1
        for extra in ({}, {"stream": True}):
            response = await http.post("/v1/completions", json=body | extra)
            assert response.status_code == 200, response.text
        assert (await http.get("/health")).status_code == 200
    assert len(handle.keys) == 2


def test_a_prefix_in_one_replicas_tier_2_goes_there_when_loads_tie_and_a_device_hit_beats_it():
    policy = AffinityPolicy()
    keys = key(CHAT).prefix_keys  # 5 blocks
    policy.update_published("a", [], offload_keys=list(keys))  # all of it in a's tier 2
    policy.update_published("b", [])
    assert policy.prefix_credit("a", keys) == 5 * 0.5 and policy.prefix_credit("b", keys) == 0
    for _ in range(20):  # never the least-loaded tie-break's random choice
        assert policy.choose(key(CHAT), {"a": 1, "b": 1}) == ("a", PREFIX)
    # the same chain on b's device: b; a device chain continued in tier 2 counts both
    policy.update_published("b", list(keys))
    assert policy.choose(key(CHAT), {"a": 1, "b": 1}) == ("b", PREFIX)
    policy.update_published("a", list(keys[:4]), offload_keys=list(keys[4:]))
    policy.update_published("b", list(keys[:4]))
    assert policy.prefix_credit("a", keys) == 4.5
    assert policy.choose(key(CHAT), {"a": 1, "b": 1}) == ("a", PREFIX)
    # tier 2 continues a device chain only from its start: a later block alone is no match
    policy.update_published("a", [], offload_keys=list(keys[1:]))
    assert policy.prefix_credit("a", keys) == 0
    policy.retain({"b"})
    assert policy.prefix_credit("a", keys) == 0
