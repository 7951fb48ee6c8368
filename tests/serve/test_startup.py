"""A request that arrives while the fleet's first replica starts, on the session cluster
(routing: prefix; the replica is held back by taking the CPUs its placement group needs):
503 + Retry-After (engine_starting) at once, while Serve still reports the app DEPLOYING;
then, once the replica is placed and has loaded its model, 200."""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from .test_fleet import _app_running, _deploy_config, _replica_states, _wait_for
from .test_handles import TINY

pytestmark = pytest.mark.ray

BODY = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}


@ray.remote(num_cpus=0)
class _Hold:
    """Takes the cluster's spare CPUs while it lives."""

    def ready(self) -> bool:
        return True


def _states(serve, app: str, deployment: str) -> dict[str, int]:
    """The deployment's replicas by state ({} while the app is still being built)."""
    status = serve.status().applications.get(app)
    deployment_status = status.deployments.get(deployment) if status is not None else None
    return {} if deployment_status is None else dict(deployment_status.replica_states)


def _assert_starting(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "5"
    assert response.json()["error"]["code"] == "engine_starting"


def test_a_request_during_the_first_start_is_503_retry_after_and_200_once_the_replica_runs(serve_session, serve_port):
    serve = serve_session
    url = f"http://127.0.0.1:{serve_port}/v1/completions"
    # all the cluster's CPUs but 0.15: room for the ingress (0.1), not for LLMServer's
    # placement group (0.4); placed once the replicas of earlier tests are gone
    hold = _Hold.options(num_cpus=round(ray.cluster_resources()["CPU"] - 0.15, 2)).remote()
    ray.get(hold.ready.remote(), timeout=120)
    try:
        _deploy_config(TINY | {"routing": "prefix"}, num_replicas=1, name="starting")
        _wait_for(lambda: _states(serve, "starting", "OpenAIIngress") == {"RUNNING": 1}, 120, "the ingress")
        assert _states(serve, "starting", "LLMServer") == {"STARTING": 1}
        for extra in ({}, {"stream": True}):
            _assert_starting(httpx.post(url, json=BODY | extra, timeout=30))  # at once, not held in the proxy
        assert serve.status().applications["starting"].status == "DEPLOYING"  # not ready: serve.run still waits
    finally:
        ray.kill(hold)
    # placed now; until its model is loaded every answer is the same 503, then 200
    deadline = time.monotonic() + 240
    while (response := httpx.post(url, json=BODY, timeout=30)).status_code != 200:
        _assert_starting(response)
        assert time.monotonic() < deadline, "the replica did not start"
        time.sleep(0.5)
    assert response.json()["usage"]["completion_tokens"] == 2
    _wait_for(lambda: _app_running(serve, "starting"), 60, "the app RUNNING")
    assert _replica_states(serve, "starting") == {"RUNNING": 1}
