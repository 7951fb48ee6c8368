"""LoRA telemetry: adapters by state, slot loads and evictions, requests per adapter, read
from a run that swaps two adapters through one slot; absent from an engine without LoRA."""

from __future__ import annotations

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from rayserve_paged import LoRARequest, SamplingParams
from rayserve_paged.config import EngineConfig
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.telemetry import ReplicaTelemetry, TelemetryConfig, names
from tests.peft_adapters import write_adapter

from .readings import Readings
from .test_prometheus import DOCS


def test_lora_metrics_count_the_run(tiny_opt, swap_run, tmp_path):
    paths = [write_adapter(tiny_opt, tmp_path / f"a{i}", "opt", "attn", 4, 8, seed=i) for i in range(2)]
    engine = LLMEngine(EngineConfig(
        model=tiny_opt, max_model_len=128, kv_cache_memory_gb=0.02, swap_space_gb=0.01, max_loras=1, max_lora_rank=8,
        lora_modules={"a0": str(paths[0]), "a1": str(paths[1]), "unused": str(paths[1])},
    ))  # fmt: skip
    reader = InMemoryMetricReader()
    telemetry = ReplicaTelemetry(engine, TelemetryConfig(replica="lora-replica"), readers=[reader])
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        for i, name in enumerate(["a0", "a1", None, "a0"]):
            lora = engine.loras.get(name)
            engine.add_request(f"r{i}", None, params, prompt_token_ids=[1, 5 + i, 9], lora_request=lora)
        readings = Readings.collect(reader)
        assert readings.value(names.LORA_ADAPTERS, state="registered") == 3
        assert readings.value(names.LORA_ADAPTERS, state="resident") == 0
        engine.step()  # a0 runs; a1 waits for the one slot (and everything behind it)
        readings = Readings.collect(reader)
        assert readings.value(names.LORA_ADAPTERS, state="active") == 1
        while engine.has_unfinished_requests():
            engine.step()
        readings = Readings.collect(reader)
        assert readings.value(names.LORA_SLOT_LOADS) == 3  # a0, a1, a0 again
        assert readings.value(names.LORA_SLOT_EVICTIONS) == 2
        assert [readings.value(names.LORA_REQUESTS, lora_name=n) for n in ("a0", "a1", "unused")] == [2, 1, 0]
        assert readings.value(names.LORA_ADAPTERS, state="resident") == 1
        assert readings.value(names.LORA_ADAPTERS, state="active") == 0
        assert all(p.attributes[names.REPLICA] == "lora-replica" for n in names.LORA_INSTRUMENTS for p in readings.metrics[n])
    finally:
        telemetry.shutdown()
    # the engine without LoRA exports none of them
    assert not any(n in Readings.collect(swap_run.reader).metrics for n in names.LORA_INSTRUMENTS)
    doc = DOCS.read_text()
    assert all(f"`{n}`" in doc for n in names.LORA_INSTRUMENTS)


def test_an_unloaded_adapters_series_are_removed(tiny_opt, tmp_path):
    path = write_adapter(tiny_opt, tmp_path / "a", "opt", "attn", 4, 8, seed=1)
    engine = LLMEngine(EngineConfig(
        model=tiny_opt, max_model_len=128, kv_cache_memory_gb=0.02, swap_space_gb=0.01, max_lora_rank=8,
        enable_lora=True, lora_modules_root=str(tmp_path), max_cpu_loras=2,
    ))  # fmt: skip
    reader = InMemoryMetricReader()
    telemetry = ReplicaTelemetry(engine, TelemetryConfig(replica="r"), readers=[reader])
    try:
        for cycle in range(30):  # load / use / unload: only the registered adapter has a series
            name = f"cycle-{cycle}"
            engine.load_lora(name, str(path))
            engine.add_request(name, None, SamplingParams(max_tokens=1), prompt_token_ids=[1, 5], lora_request=name)
            while engine.has_unfinished_requests():
                engine.step()
            engine.remove_lora(name)
            if cycle % 10 == 9:
                points = Readings.collect(reader).metrics.get(names.LORA_REQUESTS, [])
                series = [p.attributes.get(names.LORA_NAME) for p in points]
                assert series == [], series
        engine.load_lora("kept", str(path))
        readings = Readings.collect(reader)
        assert [p.attributes[names.LORA_NAME] for p in readings.metrics[names.LORA_REQUESTS]] == ["kept"]
        assert readings.value(names.LORA_ADAPTERS, state="registered") == 1
    finally:
        telemetry.shutdown()
