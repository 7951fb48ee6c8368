"""Scaling on KV pressure on the session cluster (a tiny model, CPU, fractional CPUs): a few
long requests (far below target_ongoing_requests) scale LLMServer 1 -> 2 under
`autoscaling_policy: kv`; idle, it scales back to 1.
"""

from __future__ import annotations

import pytest
import ray

from rayserve_paged import SamplingParams

from .test_fleet import _done, _replica_states, _schedulers, _wait_for
from .test_handles import _deploy

pytestmark = pytest.mark.ray


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
