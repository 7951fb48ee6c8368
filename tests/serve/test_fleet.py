"""Running a fleet on the session cluster (tiny models, CPU, fractional CPUs), deployed as
`serve deploy` does:

- one GET /metrics sees both replicas' series;
- 2 -> 1 while long streams run on both replicas: the removed replica finishes its streams.

(Scaling on KV pressure is in test_kv_autoscaling.py: it deploys through `serve.run`, and an
imperative deploy drops the apps deployed from a config, so it cannot share this file's app.)
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray

from rayserve_paged import SamplingParams
from rayserve_paged.deployments.fleet_metrics import SCHEDULER_NAMESPACE, fleet_scheduler_names

from .test_handles import TINY

pytestmark = pytest.mark.ray


def _replica_states(serve, app: str) -> dict[str, int]:
    return dict(serve.status().applications[app].deployments["LLMServer"].replica_states)


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _schedulers(app: str) -> dict[str, object]:
    actors = {}
    for name in fleet_scheduler_names(app):
        try:
            actors[name] = ray.get_actor(name, namespace=SCHEDULER_NAMESPACE)
        except ValueError:  # gone since the listing
            pass
    return actors


def _done(response) -> bool:
    try:
        response.result(timeout_s=0)
        return True
    except TimeoutError:
        return False
    except Exception:  # cancelled or failed: no longer load
        return True


def _deploy_config(args: dict, num_replicas: int, name: str = "fleet") -> None:
    """Deploy `name` as `serve deploy` would: the replica count is a deployment-level
    override, so changing it is a lightweight update (no replica is restarted)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    app = {
        "name": name, "route_prefix": "/", "import_path": "rayserve_paged.app:build_app", "args": args,
        "deployments": [{"name": "LLMServer", "num_replicas": num_replicas}],
    }  # fmt: skip
    _get_global_client().deploy_apps(ServeDeploySchema(applications=[app]))


@pytest.fixture(scope="module")
def two_replicas(ray_cluster, serve_port):
    """The whole app (HTTP ingress included) with 2 LLMServer replicas and the default drain
    (graceful_shutdown_timeout_s 300)."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
    args = TINY | {"model": "tiny-opt", "max_model_len": 1100, "graceful_shutdown_wait_loop_s": 0.5}
    _deploy_config(args, num_replicas=2)
    _wait_for(lambda: _app_running(serve) and _replica_states(serve, "fleet") == {"RUNNING": 2}, 300, "2 replicas")
    yield args
    serve.delete("fleet")


@pytest.fixture()
def fleet(two_replicas):
    """The fleet at 2 replicas, each with its engine: scaled back up when a test before scaled
    it down (a lightweight update, as `serve deploy` of a new count is)."""
    from ray import serve

    if _replica_states(serve, "fleet") != {"RUNNING": 2}:
        _deploy_config(two_replicas, num_replicas=2)
    _wait_for(lambda: _app_running(serve) and _replica_states(serve, "fleet") == {"RUNNING": 2}
              and len(_schedulers("fleet")) == 2, 300, "2 replicas with their engines")  # fmt: skip
    return two_replicas


def _app_running(serve, name: str = "fleet") -> bool:
    app = serve.status().applications.get(name)
    return app is not None and app.status == "RUNNING"


def test_one_scrape_sees_every_replica(fleet, serve_port):
    from prometheus_client.parser import text_string_to_metric_families

    assert len(_schedulers("fleet")) == 2
    response = httpx.get(f"http://127.0.0.1:{serve_port}/metrics", timeout=60)  # no key needed
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    replicas = {s.labels["replica"] for s in families["rayserve_paged_kv_cache_usage"].samples}
    assert len(replicas) == 2
    for name in ("rayserve_paged_kv_cache_blocks", "rayserve_paged_kv_cache_fragmentation", "rayserve_paged_tokens"):
        assert {s.labels["replica"] for s in families[name].samples} == replicas, name


def test_scale_down_lets_the_removed_replica_finish_its_streams(fleet, serve_port):
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name="fleet")
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    schedulers = _schedulers("fleet")
    assert len(schedulers) == 2

    async def stream(i: int) -> tuple[int, bool]:
        n, finished = 0, False
        async for out in handle.options(stream=True).generate_stream.remote(f"stream {i}", params):
            n += sum(len(o.token_ids) for o in out.outputs)  # deltas: the new tokens of each step
            finished = out.finished
        return n, finished

    async def run() -> list[tuple[int, bool]]:
        tasks = [asyncio.ensure_future(stream(i)) for i in range(6)]
        # every replica is streaming before one of them is removed (the tiny model runs 1000 tokens
        # in 2-3 s, so the replicas are asked at once and often, or a poll can miss the overlap)
        deadline = time.monotonic() + 120
        while True:
            stats = await asyncio.gather(*(a.stats.remote() for a in schedulers.values()))
            if all(s["num_unfinished_requests"] > 0 for s in stats):
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.02)
        _deploy_config(fleet, num_replicas=1)
        await asyncio.to_thread(_wait_for, _draining_or_gone, 120, "a replica to start draining")
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert results == [(1000, True)] * 6  # every stream ran to its last token, none was cut
    _wait_for(lambda: _replica_states(serve, "fleet") == {"RUNNING": 1}, 120, "one replica left")
    assert len(_schedulers("fleet")) == 1


def _draining_or_gone() -> bool:
    """The controller has picked the replica to remove: it is STOPPING (draining its
    streams), or already stopped when its streams ended between two polls."""
    from ray import serve

    states = _replica_states(serve, "fleet")
    return states.get("STOPPING", 0) > 0 or states == {"RUNNING": 1}
