from __future__ import annotations

from dataclasses import dataclass

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from rayserve_paged import SamplingParams
from rayserve_paged.config import EngineConfig
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.engine.outputs import RequestOutput
from rayserve_paged.models.tiny import make_tiny_model
from rayserve_paged.telemetry import ReplicaTelemetry, TelemetryConfig

from .readings import Readings

REPLICA = "replica-a"
NUM_REQUESTS = 4
MAX_TOKENS = 48


@dataclass
class SwapRun:
    """A finished generation that preempted with swap, and what telemetry saw of it."""

    engine: LLMEngine
    telemetry: ReplicaTelemetry
    reader: InMemoryMetricReader
    finished: list[RequestOutput]
    max_gpu_blocks_used: float  # the largest used-block reading taken between steps
    max_swapped: float  # the largest swapped-requests reading taken between steps


def start_engine(model_dir: str, **options) -> LLMEngine:
    # 12 blocks of 16 tokens; 4 requests of 20 + 48 tokens need 20: swap preemption is forced
    config = EngineConfig(
        model=model_dir,
        max_model_len=192,
        num_gpu_blocks_override=12,
        swap_space_gb=0.05,
        preemption_mode="swap",
        enable_prefix_caching=False,
        **options,
    )
    return LLMEngine(config)


def add_requests(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        engine.add_request(f"req-{i}", None, params, prompt_token_ids=list(range(10 + i, 30 + i)))


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory) -> str:
    return str(make_tiny_model("opt", tmp_path_factory.mktemp("telemetry-opt")))


@pytest.fixture(scope="session")
def swap_run(tiny_opt) -> SwapRun:
    """Runs once per session: the other tests read its engine and outputs."""
    engine = start_engine(tiny_opt)
    reader = InMemoryMetricReader()
    telemetry = ReplicaTelemetry(engine, TelemetryConfig(replica=REPLICA), readers=[reader])
    add_requests(engine)
    finished, max_used, max_swapped = [], 0.0, 0.0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        telemetry.record_outputs(outputs)
        finished += [o for o in outputs if o.finished]
        readings = Readings.collect(reader)
        max_used = max(max_used, readings.value("rayserve_paged.kv_cache.blocks", pool="device", state="used"))
        max_swapped = max(max_swapped, readings.value("rayserve_paged.scheduler.requests", state="swapped"))
    yield SwapRun(engine, telemetry, reader, finished, max_used, max_swapped)
    telemetry.shutdown()
