"""Every config in configs/ loads, validates and builds (no cluster, no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rayserve_paged.app import AppArgs, build_app, llm_server_options, placement_group_bundles

ALL_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
FLAT, SERVE_LLM = "rayserve_paged.app:build_app", "rayserve_paged.app:build_openai_app"


def _import_path(path: Path) -> str:
    (app,) = yaml.safe_load(path.read_text())["applications"]
    return app["import_path"]


CONFIGS = [p for p in ALL_CONFIGS if _import_path(p) == FLAT]  # the flat args (one model)
SERVE_LLM_CONFIGS = [p for p in ALL_CONFIGS if _import_path(p) == SERVE_LLM]  # Ray Serve LLM's llm_configs


def _app_args(path: Path) -> dict:
    config = yaml.safe_load(path.read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "rayserve_paged.app:build_app"
    return app["args"]


def test_all_configs_are_here():
    assert {_import_path(p) for p in ALL_CONFIGS} == {FLAT, SERVE_LLM}
    assert {p.name for p in SERVE_LLM_CONFIGS} >= {"serve-llm-two-models.yaml"}
    assert {p.name for p in CONFIGS} >= {
        "smollm2.yaml", "tiny.yaml", "opt13b.yaml", "opt13b-tp2.yaml", "llama3-8b.yaml", "llama3.1-8b-instruct.yaml",
        "qwen2.5-7b-instruct.yaml", "qwen3-8b.yaml", "gemma-2-9b-it.yaml",
    }  # fmt: skip


@pytest.mark.parametrize(
    "name", ["llama3.1-8b-instruct.yaml", "qwen2.5-7b-instruct.yaml", "qwen3-8b.yaml", "gemma-2-9b-it.yaml"]
)
def test_gpu_model_configs_scale_on_kv_pressure_with_a_bounded_context(name):
    args = AppArgs(**_app_args(next(p for p in CONFIGS if p.name == name)))
    assert args.autoscaling_policy == "kv" and args.autoscaling_config["max_replicas"] == 4
    assert args.device == "cuda" and args.dtype == "bfloat16"
    assert args.max_model_len == (8192 if name.startswith("gemma") else 32768)
    assert args.enable_chunked_prefill and args.max_num_batched_tokens == 8192


@pytest.mark.parametrize(
    ("name", "tool_call_parser", "reasoning_parser"),
    [("qwen2.5-7b-instruct.yaml", "hermes", None), ("qwen3-8b.yaml", "hermes", "qwen3"),
     ("llama3.1-8b-instruct.yaml", "llama3_json", None)],
)  # fmt: skip
def test_chat_model_configs_set_their_parsers(name, tool_call_parser, reasoning_parser):
    args = AppArgs(**_app_args(next(p for p in CONFIGS if p.name == name)))
    assert (args.tool_call_parser, args.reasoning_parser) == (tool_call_parser, reasoning_parser)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_builds(path):
    args = AppArgs(**_app_args(path))
    app = build_app(args)
    assert app is not None
    bundles = placement_group_bundles(args)
    assert len(bundles) == 1 + args.tensor_parallel_size
    on_gpu = args.device == "cuda"
    assert all(("GPU" in b) == on_gpu for b in bundles[1:]) and "GPU" not in bundles[0]
    options = llm_server_options(args)
    assert options["placement_group_strategy"] == "STRICT_PACK"
    replica_cpus = options["ray_actor_options"]["num_cpus"]
    if args.tensor_parallel_size == 1:  # the scheduler actor hosts rank 0 in rank 0's bundle
        assert bundles[0]["CPU"] == replica_cpus and bundles[1]["CPU"] == args.worker_cpus + args.scheduler_cpus
    else:
        assert bundles[0]["CPU"] == replica_cpus + args.scheduler_cpus
        assert all(b["CPU"] == args.worker_cpus for b in bundles[1:])


def test_tiny_config_fits_two_cpus_with_two_replicas():
    args = AppArgs(**_app_args(next(p for p in CONFIGS if p.name == "tiny.yaml")))
    per_replica = sum(b["CPU"] for b in placement_group_bundles(args))
    assert args.autoscaling_config["max_replicas"] == 2
    assert 2 * per_replica <= 2.0  # the HTTP app runs inside the replicas


def test_smollm2_config_is_one_replica_whose_threads_fit_two_cpus():
    """One replica with two torch threads (measured faster than two replicas of one thread,
    docs/benchmarks/15-quantized.md (15a)): its reservation and its threads fit the 2-core machine."""
    args = AppArgs(**_app_args(next(p for p in CONFIGS if p.name == "smollm2.yaml")))
    assert args.num_replicas == 1 and args.autoscaling_config is None
    assert sum(b["CPU"] for b in placement_group_bundles(args)) <= 2.0
    assert args.num_cpu_threads == 2


def test_opt13b_is_the_paper_setup():
    args = AppArgs(**_app_args(next(p for p in CONFIGS if p.name == "opt13b.yaml")))
    assert (args.model, args.block_size, args.gpu_memory_utilization, args.swap_space_gb) == (
        "facebook/opt-13b", 16, 0.9, 4
    )
    assert args.autoscaling_config["min_replicas"] == 1 and args.autoscaling_config["max_replicas"] == 4


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"block_size": 12}, "block_size"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"no_such_option": 1}, "no_such_option"),
        # a budget below max_model_len needs chunked prefill
        ({"max_model_len": 4096, "max_num_batched_tokens": 1024, "enable_chunked_prefill": False}, "max_num_batched_tokens"),
    ],
)
def test_invalid_args_fail_at_build_time_naming_the_field(bad, field):
    with pytest.raises(ValidationError, match=field):
        build_app({"model": "tiny-opt"} | bad)


@pytest.mark.parametrize("tp", (1, 2, 4))
def test_scheduler_actor_takes_the_bundle_the_layout_reserves_for_it(tp):
    from rayserve_paged.engine.ray_executor import replica_bundles, scheduler_actor_options

    args = AppArgs(model="tiny-opt", device="cpu", tensor_parallel_size=tp, scheduler_cpus=0.25, worker_cpus=0.5)
    replica_cpus = 0.125
    bundles = replica_bundles(args, replica_cpus, args.scheduler_cpus, args.worker_cpus, gpu=False)
    options = scheduler_actor_options(args, args.scheduler_cpus, args.worker_cpus, pg=object())
    index = options["scheduling_strategy"].placement_group_bundle_index
    if tp == 1:  # rank 0 runs in the scheduler actor: it takes rank 0's bundle whole
        assert index == 1 and options["num_cpus"] == bundles[1]["CPU"] == 0.75
        assert bundles[0] == {"CPU": replica_cpus}
    else:  # the scheduler shares bundle 0 with the replica; each rank has a bundle of its own
        assert index == 0 and options["num_cpus"] + replica_cpus == bundles[0]["CPU"]
        assert bundles[1:] == [{"CPU": 0.5}] * tp
    # the same CPUs in all as before the scheduler hosted rank 0
    assert sum(b["CPU"] for b in bundles) == replica_cpus + args.scheduler_cpus + tp * args.worker_cpus


def _models(path: Path) -> list[AppArgs]:
    """Each model's AppArgs, in either form."""
    from rayserve_paged.app import model_args_of
    from rayserve_paged.serve_llm import translate

    if _import_path(path) == FLAT:
        return [AppArgs(**_app_args(path))]
    (app,) = yaml.safe_load(path.read_text())["applications"]
    return [model_args_of(m) for m in translate(app["args"], frozenset(AppArgs.model_fields)).models]


def test_serve_llm_two_models_fits_two_cpus_with_every_replica_and_the_ingress():
    """smollm2 (one replica, two threads) and the tiny OPT at its most replicas, plus the
    ingress, within the 2-core machine's CPUs."""
    from rayserve_paged.app import build_openai_app

    path = next(p for p in SERVE_LLM_CONFIGS if p.name == "serve-llm-two-models.yaml")
    (app,) = yaml.safe_load(path.read_text())["applications"]
    assert build_openai_app(app["args"]) is not None
    smollm2, tiny = _models(path)
    assert (smollm2.model, smollm2.served_model_name, smollm2.device, smollm2.num_cpu_threads) == (
        "smollm2", "smollm2-135m-instruct", "cpu", 2)  # fmt: skip
    assert (tiny.model, tiny.served_model_name, tiny.device) == ("tiny-opt", "tiny-opt", "cpu")
    assert smollm2.num_replicas == 1 and smollm2.autoscaling_config is None
    reserved = sum(b["CPU"] for b in placement_group_bundles(smollm2))
    reserved += tiny.autoscaling_config["max_replicas"] * sum(b["CPU"] for b in placement_group_bundles(tiny))
    reserved += app["args"]["ingress_deployment_config"]["ray_actor_options"]["num_cpus"]
    assert reserved <= 2.0


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.name)
def test_every_config_lets_the_app_decide_what_waits_and_bounds_the_request_time(path):
    """Serve never answers first: its proxy's queue is unbounded (max_queued_requests -1, so
    no text 503 without Retry-After) and a replica takes every request the app's admission
    may admit (max_ongoing_requests >= max_pending_requests), which queues and sheds by time;
    a request shed by time is answered before the proxy's request_timeout_s (then 408)."""
    from ray.serve.schema import HTTPOptionsSchema

    config = yaml.safe_load(path.read_text())
    http = HTTPOptionsSchema.model_validate(config["http_options"])
    assert http.request_timeout_s is not None and 60 <= http.request_timeout_s <= 3600
    for args in _models(path):
        assert args.max_queued_requests == -1 and args.max_pending_requests <= args.max_ongoing_requests
        assert llm_server_options(args)["max_queued_requests"] == -1
        assert args.max_queue_wait_s < http.request_timeout_s
