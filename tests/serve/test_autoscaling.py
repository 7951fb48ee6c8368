"""Load on tiny.yaml-like settings scales LLMServer from 1 to 2 replicas, each with its own
scheduler actor and worker in a placement group of its own."""

from __future__ import annotations

import time

import pytest

from rayserve_paged import SamplingParams

from .conftest import wait_for_free_cpus
from .test_handles import TINY, _alive, _deploy

pytestmark = pytest.mark.ray


def _running_replicas(serve, app: str) -> int:
    status = serve.status().applications[app].deployments["LLMServer"]
    return status.replica_states.get("RUNNING", 0)


def test_load_scales_out_to_a_second_replica_with_its_own_workers(serve_session):
    autoscaling = {
        "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 1,
        "upscale_delay_s": 1, "downscale_delay_s": 600, "metrics_interval_s": 1, "look_back_period_s": 2,
    }  # fmt: skip
    # two replicas' placement groups (0.1 + 0.4 CPU each) must fit before the clock starts
    assert wait_for_free_cpus(2 * (0.1 + 0.4)) >= 1.0
    handle = _deploy(serve_session, "scale", model="tiny-opt", autoscaling_config=autoscaling)
    assert _running_replicas(serve_session, "scale") == 1
    long = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True, seed=1)
    responses = [handle.generate.remote("keep the replica busy", long) for _ in range(8)]
    deadline = time.monotonic() + 240
    while _running_replicas(serve_session, "scale") < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert _running_replicas(serve_session, "scale") == 2
    schedulers, workers = _alive("SchedulerActor"), _alive("WorkerActor")
    assert len(schedulers) == 2 and workers == []  # at TP = 1 rank 0 runs inside each scheduler actor
    from ray.util import placement_group_table

    # one placement group per replica: bundle 0 (the replica), bundle 1 (its scheduler with rank 0)
    shapes = [
        list(g["bundles"].values()) for g in placement_group_table().values() if g["state"] == "CREATED"
    ]
    assert shapes.count([{"CPU": 0.1}, {"CPU": 0.4}]) == 2
    for r in responses:
        r.cancel()
