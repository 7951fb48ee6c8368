"""Fleet options of AppArgs reach Serve's deployment config, and Serve itself validates
what AppArgs passes through (no cluster needed: build_app only builds)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayserve_paged.app import AppArgs, build_app
from rayserve_paged.deployments.autoscaling import POLICY_PATH, KVPressurePolicy

BASE = {"model": "tiny-opt", "device": "cpu"}
AUTOSCALING = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 16}


def _llm_server_config(**args):
    """The DeploymentConfig Serve built for LLMServer."""
    app = build_app(BASE | args)
    return app._bound_deployment._deployment_config


def test_kv_policy_is_serves_custom_policy_with_the_thresholds():
    config = _llm_server_config(
        autoscaling_config=AUTOSCALING, autoscaling_policy="kv", target_kv_usage=0.9, scale_down_kv_usage=0.2
    )
    policy = config.autoscaling_config.policy
    assert policy.policy_function == POLICY_PATH
    assert policy.policy_kwargs == {"target_kv_usage": 0.9, "scale_down_kv_usage": 0.2}
    assert policy.get_policy() is KVPressurePolicy  # what the controller unpickles
    assert (config.autoscaling_config.max_replicas, config.autoscaling_config.target_ongoing_requests) == (3, 16)


def test_requests_policy_is_serves_default():
    config = _llm_server_config(autoscaling_config=AUTOSCALING)
    assert AppArgs(**BASE).autoscaling_policy == "requests"
    assert config.autoscaling_config.policy.is_default_policy_function()


def test_graceful_shutdown_defaults_to_five_minutes():
    config = _llm_server_config()
    assert (config.graceful_shutdown_timeout_s, config.graceful_shutdown_wait_loop_s) == (300.0, 2.0)
    config = _llm_server_config(graceful_shutdown_timeout_s=30, graceful_shutdown_wait_loop_s=0.5)
    assert (config.graceful_shutdown_timeout_s, config.graceful_shutdown_wait_loop_s) == (30.0, 0.5)


def test_deployment_options_pass_through():
    config = _llm_server_config(
        deployment_options={"health_check_period_s": 7, "logging_config": {"log_level": "DEBUG"}}
    )
    assert config.health_check_period_s == 7
    assert config.logging_config["log_level"] == "DEBUG"


@pytest.mark.parametrize(
    "options, error, words",
    [
        ({"no_such_option": 1}, ValueError, "no_such_option"),  # serve.deployment knows no such option
        ({"health_check_period_s": -1}, ValidationError, "health_check_period_s"),  # Serve's own check
        ({"logging_config": {"log_level": "LOUD"}}, ValidationError, "log_level"),
        ({"max_ongoing_requests": 3}, ValidationError, "deployment_options.max_ongoing_requests: set by AppArgs"),
        ({"graceful_shutdown_timeout_s": 3}, ValidationError, "deployment_options.graceful_shutdown_timeout_s"),
    ],
)
def test_bad_deployment_options_fail_at_build_time_naming_the_option(options, error, words):
    with pytest.raises(error, match=words):
        build_app(BASE | {"deployment_options": options})


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"autoscaling_policy": "gpu"}, "autoscaling_policy"),
        ({"target_kv_usage": 1.5}, "target_kv_usage"),
        ({"target_kv_usage": 0.5, "scale_down_kv_usage": 0.6}, "scale_down_kv_usage"),
        ({"graceful_shutdown_timeout_s": -1}, "graceful_shutdown_timeout_s"),
        ({"autoscaling_policy": "kv", "autoscaling_config": AUTOSCALING | {"policy": {}}}, "autoscaling_config.policy"),
    ],
)
def test_bad_fleet_args_name_the_field(bad, words):
    with pytest.raises(ValidationError, match=words):
        AppArgs(**BASE | bad)


def test_lora_options_reach_the_engine_and_the_app(monkeypatch):
    from rayserve_paged.app import engine_config_of

    from tests.deployments.conftest import record_binds

    args = AppArgs(model="tiny-opt", lora_modules={"a": "/adapters/a"}, max_loras=2, allow_runtime_lora_updating=True)
    engine = engine_config_of(args)
    assert (engine.lora_modules, engine.max_loras, engine.is_lora_enabled) == ({"a": "/adapters/a"}, 2, True)
    (bound,) = record_binds(monkeypatch, args).values()
    assert bound["args"][0]["lora_modules"] == {"a": "/adapters/a"}
    assert bound["kwargs"]["http"]["allow_runtime_lora_updating"] is True
    (bound,) = record_binds(monkeypatch, AppArgs(model="tiny-opt")).values()
    assert bound["kwargs"]["http"]["allow_runtime_lora_updating"] is False  # off by default
    with pytest.raises(ValidationError, match="adapter name 'chat' is the served model's name"):
        AppArgs(model="tiny-opt", served_model_name="chat", lora_modules={"chat": "/adapters/a"})
    with pytest.raises(ValidationError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        AppArgs(model="tiny-opt", max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValidationError, match="max_lora_rank"):
        AppArgs(model="tiny-opt", max_lora_rank=65)
