"""Every config in configs/ loads, validates and builds (no cluster, no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rayserve_paged.app import AppArgs, build_app, llm_server_options, placement_group_bundles

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def _app_args(path: Path) -> dict:
    config = yaml.safe_load(path.read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "rayserve_paged.app:build_app"
    return app["args"]


def test_all_four_configs_are_here():
    assert {p.name for p in CONFIGS} >= {"tiny.yaml", "opt13b.yaml", "opt13b-tp2.yaml", "llama3-8b.yaml"}


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
    assert options["ray_actor_options"]["num_cpus"] + args.scheduler_cpus == bundles[0]["CPU"]


def test_tiny_fits_two_cpus_with_two_replicas():
    args = AppArgs(**_app_args(next(p for p in CONFIGS if p.name == "tiny.yaml")))
    per_replica = sum(b["CPU"] for b in placement_group_bundles(args))
    assert args.autoscaling_config["max_replicas"] == 2
    assert 2 * per_replica <= 2.0  # the HTTP app runs inside the replicas


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
        ({"max_model_len": 4096, "max_num_batched_tokens": 1024}, "max_num_batched_tokens"),
    ],
)
def test_invalid_args_fail_at_build_time_naming_the_field(bad, field):
    with pytest.raises(ValidationError, match=field):
        build_app({"model": "tiny-opt"} | bad)
