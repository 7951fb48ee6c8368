"""Running a fleet on the session cluster (tiny models, CPU, fractional CPUs):

- KV pressure from a few long requests (far below target_ongoing_requests) scales LLMServer
  1 -> 2 under `autoscaling_policy: kv`; idle, it scales back to 1;
- one GET /metrics sees both replicas' series;
- 2 -> 1 while long streams run on both replicas: the removed replica finishes its streams.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray

from rayserve_paged import SamplingParams
from rayserve_paged.app import AppArgs, build_app
from rayserve_paged.deployments.fleet_metrics import SCHEDULER_NAMESPACE, fleet_scheduler_names

from .test_handles import TINY, _deploy

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


def test_kv_pressure_scales_out_and_idle_scales_back(serve_session):
    # 16 blocks of 16 tokens: two requests growing to 240 tokens cannot both fit
    autoscaling = {
        "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 16,
        "upscale_delay_s": 1, "downscale_delay_s": 2, "metrics_interval_s": 1, "look_back_period_s": 2,
    }  # fmt: skip
    handle = _deploy(
        serve_session, "kvscale", autoscaling_config=autoscaling, autoscaling_policy="kv",
        num_gpu_blocks_override=16, max_model_len=256, graceful_shutdown_timeout_s=5,
    )  # fmt: skip
    assert _replica_states(serve_session, "kvscale") == {"RUNNING": 1}
    long = SamplingParams(temperature=0.0, max_tokens=230, ignore_eos=True)
    (first,) = _schedulers("kvscale").values()  # the replica under load (a new one loads a while)
    pending, peak = [], {"kv_usage": 0.0, "num_waiting": 0, "num_preemptions": 0}

    def under_pressure() -> bool:
        # 4 requests at a time: a quarter of target_ongoing_requests, so only KV pressure scales
        pending[:] = [r for r in pending if not _done(r)]
        while len(pending) < 4:
            pending.append(handle.generate.remote("fill the cache", long))
        p = ray.get(first.engine_pressure.remote(), timeout=30)
        peak.update({k: max(peak[k], p[k]) for k in peak})
        return _replica_states(serve_session, "kvscale").get("RUNNING", 0) == 2

    _wait_for(under_pressure, 240, "a second replica under KV pressure")
    assert peak["kv_usage"] > 0.85 or peak["num_waiting"] > 0 or peak["num_preemptions"] > 0, peak
    assert len(_schedulers("kvscale")) == 2  # each replica brought its own engine
    for r in pending:
        r.cancel()
    # idle (no request, an empty cache) for downscale_delay_s: back to one replica
    _wait_for(lambda: _replica_states(serve_session, "kvscale") == {"RUNNING": 1}, 120, "scale-down to 1")
    _wait_for(lambda: len(_schedulers("kvscale")) == 1, 60, "the removed replica's engine to stop")


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


def _app_running(serve, name: str = "fleet") -> bool:
    app = serve.status().applications.get(name)
    return app is not None and app.status == "RUNNING"


def test_one_scrape_sees_every_replica(two_replicas, serve_port):
    from prometheus_client.parser import text_string_to_metric_families

    assert len(_schedulers("fleet")) == 2
    response = httpx.get(f"http://127.0.0.1:{serve_port}/metrics", timeout=60)  # no key needed
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    replicas = {s.labels["replica"] for s in families["rayserve_paged_kv_cache_usage"].samples}
    assert len(replicas) == 2
    for name in ("rayserve_paged_kv_cache_blocks", "rayserve_paged_kv_cache_fragmentation", "rayserve_paged_tokens"):
        assert {s.labels["replica"] for s in families[name].samples} == replicas, name


def test_scale_down_lets_the_removed_replica_finish_its_streams(two_replicas, serve_port):
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
        # every replica is streaming before one of them is removed
        deadline = time.monotonic() + 120
        while True:
            stats = [await a.stats.remote() for a in schedulers.values()]
            if all(s["num_unfinished_requests"] > 0 for s in stats):
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.2)
        _deploy_config(two_replicas, num_replicas=1)
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
