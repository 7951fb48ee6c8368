"""`build_processor(config, routes)`: a Ray Data pipeline from batch requests to results.

    Dataset[text]  ──Preprocess──>  ──EngineStage──>  ──Postprocess──>  Dataset[output, ...]
                    CPU actors        engine actors      CPU actors
                    (1 .. max)        concurrency        (1 .. max)
                                      = (min, max)

`text` is an OpenAI batch line (`ray.data.read_text` gives it), or the line's fields as
columns (custom_id, method, url, body: `ray.data.read_json` / `read_parquet` give them);
`line`, when present, is carried through. `output` is the result line; `status_code`,
`num_output_tokens` and the engine actor's counters (`replica`, `replica_idle_s`, ...)
come with it. The engine actors are an autoscaling actor pool: Ray Data adds actors up
to `max` while rows wait (and a cluster's autoscaler adds nodes for them). An engine
actor that dies (its process, its node, or its engine: it then exits) is replaced and
its batches are retried on the replacement, at most `max_retries` times each.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rayserve_paged.batch.routes import BatchRoutes
from rayserve_paged.config import EngineConfig

# On a laptop: the embedded SmolLM2-135M-Instruct on the CPU (as configs/smollm2.yaml).
LAPTOP_ENGINE = {
    "model": "smollm2",
    "device": "cpu",
    "max_model_len": 2048,
    "kv_cache_memory_gb": 0.25,
    "swap_space_gb": 0.1,
    "max_num_seqs": 32,
}


class BatchConfig(BaseModel):
    """A batch job: the engine (the same options as serving) and how Ray Data runs it."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(**LAPTOP_ENGINE))
    served_model_name: str | None = Field(None, description="The `model` the bodies name; defaults to engine.model.")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None, description="Reads tool calls out of tool_choice 'auto' outputs (as the server's)."
    )
    concurrency: int | tuple[int, int] = Field(
        1, description="Engine actors: n (a fixed pool) or (min, max) (autoscaling between them)."
    )
    batch_size: int = Field(16, ge=1, description="Rows per batch handed to an actor.")
    max_concurrent_batches: int = Field(
        4, ge=1, description="Batches one engine actor runs at once, their requests in one continuous batch."
    )
    max_retries: int = Field(
        2, ge=0, description="Retries of a batch whose engine actor died; then its lines are answered 503."
    )
    worker_cpus: float = Field(1.0, gt=0, description="CPUs of each engine actor (of each TP rank at TP > 1).")
    cpu_stage_cpus: float = Field(0.25, gt=0, description="CPUs of each preprocess / postprocess actor.")

    @field_validator("concurrency")
    @classmethod
    def _check_concurrency(cls, value):
        low, high = (value, value) if isinstance(value, int) else value
        if not 1 <= low <= high:
            raise ValueError(f"expected n >= 1 or (min, max) with 1 <= min <= max (got {value})")
        return value

    @property
    def pool_size(self) -> tuple[int, int]:
        return (self.concurrency, self.concurrency) if isinstance(self.concurrency, int) else self.concurrency


def build_processor(config: BatchConfig, routes: type[BatchRoutes]) -> Callable:
    """The pipeline as a function of a Dataset (lazy, as Ray Data's own transforms are).
    `routes`: the class that speaks the API (batch/routes.py)."""
    import ray.data

    from rayserve_paged.batch.stages import EngineStage, Postprocess, Preprocess
    from rayserve_paged.engine.llm_engine import model_limits

    engine = config.engine.model_dump()
    low, high = config.pool_size
    routes_stage = dict(
        fn_constructor_kwargs=dict(
            routes=routes, engine=engine, info=model_limits(config.engine),
            served_model_name=config.served_model_name or config.engine.model, tool_call_parser=config.tool_call_parser,
        ),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=high),
        num_cpus=config.cpu_stage_cpus,
        batch_size=config.batch_size,
        batch_format="pyarrow",
    )  # fmt: skip
    engine_stage = dict(
        fn_constructor_kwargs=dict(engine=engine, worker_cpus=config.worker_cpus),
        # Ray Data sends each actor this many batches at once; the actor runs them together
        compute=ray.data.ActorPoolStrategy(
            min_size=low, max_size=high, max_tasks_in_flight_per_actor=config.max_concurrent_batches,
            max_concurrent_calls_per_actor=config.max_concurrent_batches,
        ),
        max_restarts=-1,  # a dead actor is always replaced ...
        max_task_retries=config.max_retries,  # ... and each of its batches retried this often
        batch_size=config.batch_size,
        batch_format="pyarrow",
        **engine_placement(config.engine, config.worker_cpus, config.cpu_stage_cpus),
    )

    def process(ds):
        ds = ds.map_batches(Preprocess, **routes_stage)
        with warnings.catch_warnings():
            # Ray Data 2.60 names no parameter for an actor's retries yet (max_restarts and
            # max_task_retries still pass as remote args, which it warns about)
            warnings.filterwarnings("ignore", "`ray_remote_args", category=DeprecationWarning)
            ds = ds.map_batches(EngineStage, **engine_stage)
        return ds.map_batches(Postprocess, **routes_stage)

    return process


def engine_placement(engine: EngineConfig, worker_cpus: float, actor_cpus: float) -> dict:
    """An engine actor's resources. TP = 1: the actor runs rank 0 itself, with its CPUs (and
    GPU). TP > 1: a placement group per actor (as a Serve replica's: the actor in bundle 0,
    a bundle per rank), made when Ray Data starts the actor."""
    from rayserve_paged.engine.ray_executor import is_gpu, rank0_in_scheduler, replica_bundles

    gpu = is_gpu(engine)
    if rank0_in_scheduler(engine):
        return {"num_cpus": worker_cpus, "num_gpus": 1 if gpu else 0}
    bundles = replica_bundles(engine, actor_cpus, 0.0, worker_cpus, gpu)
    return {"num_cpus": actor_cpus, "ray_remote_args_fn": partial(_placement_group_args, bundles)}


def _placement_group_args(bundles: list[dict[str, float]]) -> dict:
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group(bundles, strategy="STRICT_PACK")
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
    return {"scheduling_strategy": strategy}
