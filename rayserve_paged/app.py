"""The Serve application: `import_path: rayserve_paged.app:build_app`.

    HTTP (Serve proxy) ──> LLMServer replica ──> SchedulerActor ──> Worker actors
    DeploymentHandle   ──>  (FastAPI app,          (bundle 0)         (bundles 1..TP)
                             bundle 0)

`build_app(args)` validates AppArgs once (an invalid field fails here, named) and binds the
undecorated LLMServer class, made a late-bound Serve ingress here (`serve.ingress()`): the
OpenAI app runs in the replica that owns the engine, so HTTP reaches it in one hop, and the
Python handle API is on the same deployment. Each replica gets a placement group of its
own, so an autoscaled replica always brings its own workers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rayserve_paged.config import EngineConfig
from rayserve_paged.telemetry import TelemetryConfig


class AppArgs(EngineConfig):
    """Engine options (EngineConfig's fields) plus how Serve runs the deployments."""

    served_model_name: str | None = Field(None, description="Model name in the API; defaults to `model`.")
    api_key: str | None = Field(None, description="Require `Authorization: Bearer <api_key>` (not on /health).")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Serve autoscaling for LLMServer (min_replicas, max_replicas, target_ongoing_requests ...)."
    )
    num_replicas: int = Field(1, ge=1, description="Fixed LLMServer replicas when autoscaling_config is unset.")
    max_ongoing_requests: int = Field(256, ge=1, description="Requests in flight per LLMServer replica.")
    max_queued_requests: int = Field(
        -1,
        ge=-1,
        description=(
            "Requests each caller (ingress replica) queues for LLMServer beyond max_ongoing_requests; "
            "more are answered 503 + Retry-After (Serve's BackPressureError). -1 = no limit."
        ),
    )
    ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 0.1}, description="Options of the LLMServer replica actor."
    )
    scheduler_cpus: float = Field(
        0.1, ge=0, description="CPUs of the SchedulerActor (bundle 0 at TP > 1; added to rank 0's bundle at TP = 1)."
    )
    worker_cpus: float = Field(
        1.0, gt=0, description="CPUs of each tensor-parallel rank (a Worker actor; at TP = 1 rank 0 in the SchedulerActor)."
    )
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="How a replica's bundles are placed."
    )
    ingress_cpus: float = Field(
        0.1, ge=0, description="Deprecated, ignored: the HTTP app runs in the LLMServer replicas."
    )
    ingress_replicas: int = Field(
        1, ge=1, description="Deprecated, ignored: the HTTP app runs in the LLMServer replicas."
    )
    ingress_max_ongoing_requests: int = Field(
        1024, ge=1, description="Deprecated, ignored: the HTTP app runs in the LLMServer replicas."
    )
    max_pending_requests: int = Field(
        256,
        ge=1,
        description=(
            "Completion requests in flight per LLMServer replica; more are answered 503 + Retry-After at once. "
            "Keep it <= max_ongoing_requests, or Serve queues the excess before it gets here."
        ),
    )
    max_request_body_bytes: int = Field(
        1 << 20, ge=1, description="Largest HTTP request body; a larger one is answered 413 before it is parsed."
    )
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig, description="Metrics export (Prometheus port, OTLP interval)."
    )


def uses_gpu(args: EngineConfig) -> bool:
    if args.device != "auto":
        return args.device == "cuda"
    import ray

    if ray.is_initialized():
        return bool(ray.cluster_resources().get("GPU", 0))
    import torch

    return torch.cuda.is_available()


def placement_group_bundles(args: AppArgs) -> list[dict[str, float]]:
    """Bundle 0: the replica (and its SchedulerActor at TP > 1); then one bundle per TP rank
    (at TP = 1 the SchedulerActor hosting rank 0)."""
    from rayserve_paged.engine.ray_executor import replica_bundles

    replica_cpus = float(args.ray_actor_options.get("num_cpus", 1.0))
    return replica_bundles(args, replica_cpus, args.scheduler_cpus, args.worker_cpus, uses_gpu(args))


def engine_config_of(args: AppArgs) -> EngineConfig:
    return EngineConfig(**args.model_dump(include=set(EngineConfig.model_fields)))


def llm_server_options(args: AppArgs) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": "LLMServer",
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "ray_actor_options": dict(args.ray_actor_options),
        "placement_group_bundles": placement_group_bundles(args),
        "placement_group_strategy": args.placement_group_strategy,
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
    }
    if args.autoscaling_config is not None:
        options["autoscaling_config"] = dict(args.autoscaling_config)
    else:
        options["num_replicas"] = args.num_replicas
    return options


def build_app(args: AppArgs | dict):
    """Serve application builder (also what `serve run configs/*.yaml` calls)."""
    from ray import serve

    from rayserve_paged.deployments.llm_server import LLMServer

    if not isinstance(args, AppArgs):
        args = AppArgs(**args)
    engine = engine_config_of(args)
    http = {
        "served_model_name": args.served_model_name or args.model,
        "api_key": args.api_key,
        "max_request_body_bytes": args.max_request_body_bytes,
        "max_pending_requests": args.max_pending_requests,
    }
    return serve.deployment(serve.ingress()(LLMServer), **llm_server_options(args)).bind(
        engine.model_dump(),
        scheduler_cpus=args.scheduler_cpus,
        worker_cpus=args.worker_cpus,
        telemetry=args.telemetry.model_dump(),
        http=http,
    )
