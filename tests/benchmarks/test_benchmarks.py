"""Behaviour of the memory and scheduler-step benchmarks on quick runs (never their speed)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import memory, scheduler_step
from rayserve_paged import cli

SYSTEMS = ("paged", "orca_max", "orca_pow2", "orca_oracle", "paged_block1")
DATASETS = ("sharegpt", "alpaca")


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-memory")
    assert cli.main(["bench", "memory", "--out", str(out), "--quick", "--seed", "0"]) == 0
    return out


@pytest.fixture(scope="module")
def memory_json(memory_run):
    return json.loads((memory_run / "memory.json").read_text())


@pytest.fixture(scope="module")
def scheduler_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-scheduler")
    assert cli.main(["bench", "scheduler", "--out", str(out), "--quick"]) == 0
    return json.loads((out / "scheduler.json").read_text())


# ---------------------------------------------------------------------------- memory


def test_memory_writes_json_and_png(memory_run):
    png = (memory_run / "memory.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("system", SYSTEMS)
def test_memory_json_has_required_keys_with_sane_values(memory_json, dataset, system):
    figures = memory_json[dataset][system]
    assert 0 < figures["utilization"] <= 1
    assert figures["mean_batched_saturated"] > 0
    shares = [figures[k] for k in ("pool_token_state", "pool_reservation", "pool_internal", "pool_unallocated")]
    assert all(s >= 0 for s in shares)
    assert math.isclose(sum(shares), 1.0, rel_tol=1e-9)


@pytest.mark.parametrize("dataset", DATASETS)
def test_memory_orderings(memory_json, dataset):
    d = memory_json[dataset]
    util = {s: d[s]["utilization"] for s in SYSTEMS}
    batched = {s: d[s]["mean_batched_saturated"] for s in SYSTEMS}
    assert util["paged"] > util["orca_oracle"] > util["orca_pow2"] > util["orca_max"]
    assert batched["paged_block1"] >= batched["paged"] > batched["orca_oracle"]
    assert batched["orca_oracle"] > batched["orca_pow2"] > batched["orca_max"]
    # 15,000 slots hold 7 reservations of 2048, and the queue never empties.
    assert batched["orca_max"] == pytest.approx(7.0)
    # Block size 1 wastes nothing; Orca never preempts; Oracle reserves nothing unused.
    assert util["paged_block1"] == pytest.approx(1.0)
    assert d["paged_block1"]["pool_internal"] == pytest.approx(0.0)
    assert d["orca_oracle"]["pool_internal"] == pytest.approx(0.0)
    assert all(d[s]["preemptions_saturated"] == 0 for s in ("orca_max", "orca_pow2", "orca_oracle"))
    assert d["paged"]["pool_reservation"] == 0


def test_memory_sharegpt_paged_is_near_zero_waste(memory_json):
    d = memory_json["sharegpt"]
    assert d["paged"]["utilization"] > 0.95
    assert d["paged"]["mean_batched_saturated"] > 1.5 * d["orca_oracle"]["mean_batched_saturated"]


def test_memory_poisson_figures_and_config(memory_json):
    cfg = memory_json["config"]
    assert cfg["num_slots"] == 15_000 and cfg["max_seq_len"] == 2048 and cfg["block_size"] == 16
    assert memory_json["seed"] == 0
    for dataset in DATASETS:
        for system in ("paged", "orca_max", "orca_pow2", "orca_oracle"):
            figures = memory_json[dataset][system]
            assert figures["mean_batched_poisson"] > 0
            assert figures["paper_mean_batched_poisson"] > 0
        assert memory_json[dataset]["orca_max"]["mean_batched_poisson"] <= 7.0 + 1e-9
    assert {t["target"] for t in memory_json["targets"]} and all(
        isinstance(t["passed"], bool) for t in memory_json["targets"]
    )


def test_requests_are_deterministic_and_clipped():
    dataset = memory.DATASETS["sharegpt"]
    a = memory.sample_requests(dataset, 500, seed=3)
    assert a == memory.sample_requests(dataset, 500, seed=3)
    assert a != memory.sample_requests(dataset, 500, seed=4)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.total_len <= 2048 for r in a)
    timed = memory.with_poisson_arrivals(a, 2.0, seed=3, dataset="sharegpt")
    times = [r.arrival_time for r in timed]
    assert times == sorted(times) and times[0] > 0
    assert [r.total_len for r in timed] == [r.total_len for r in a]


def test_reservation_sizes():
    r = memory.Request(0, prompt_len=100, output_len=29)
    assert memory.reserve_max(r) == 2048
    assert memory.reserve_pow2(r) == 256  # 129 -> 256
    assert memory.reserve_pow2(memory.Request(0, 100, 28)) == 128  # 128 exactly
    assert memory.reserve_pow2(memory.Request(0, 1500, 548)) == 2048
    assert memory.reserve_oracle(r) == 129


def test_contiguous_allocator_first_fit_and_coalescing():
    alloc = memory.ContiguousAllocator(100)
    a, b, c = alloc.allocate(30), alloc.allocate(30), alloc.allocate(30)
    assert (a, b, c) == (0, 30, 60)
    assert alloc.allocate(20) is None  # 10 left
    alloc.free(b, 30)
    assert alloc.allocate(40) is None  # external fragmentation: 30 + 10, not contiguous
    alloc.free(c, 30)  # coalesces 30..100
    assert alloc.num_free == 70
    assert alloc.allocate(70) == 30
    alloc.free(a, 30)
    alloc.free(30, 70)
    assert alloc.num_free == 100 and alloc.allocate(100) == 0


def test_orca_max_holds_seven_and_finishes_requests():
    system = memory.OrcaSystem(memory.reserve_max)
    for i in range(10):
        system.add(memory.Request(i, prompt_len=10, output_len=3))
    records = [system.step() for _ in range(6)]
    assert [r.num_batched for r in records] == [7, 7, 7, 3, 3, 3]
    assert sum(r.num_finished for r in records) == 10
    assert system.is_idle
    first = records[0]
    assert first.num_computed_tokens == 70 and first.token_state == 70
    assert first.reservation == 7 * 3 and first.internal == 7 * (2048 - 13)


def test_paged_system_generates_exact_output_lengths():
    system = memory.PagedSystem(block_size=16)
    for i, out_len in enumerate((1, 5, 17)):
        system.add(memory.Request(i, prompt_len=20, output_len=out_len))
    num_steps = 0
    while not system.is_idle:
        system.step()
        num_steps += 1
    assert num_steps == 17
    assert system.block_manager.num_free_gpu_blocks() == system.block_manager.gpu.num_blocks


# ---------------------------------------------------------------------------- scheduler step


def test_scheduler_json_has_required_keys(scheduler_json):
    assert scheduler_json["median_us_per_step"] > 0
    assert scheduler_json["p90_us_per_step"] >= scheduler_json["median_us_per_step"]
    assert isinstance(scheduler_json["target_met"], bool)
    cases = scheduler_json["cases"]
    assert set(cases) == {"decode_256", "decode_256_no_prefix_cache", "decode_256_admit_64"}
    for figures in cases.values():
        assert figures["num_running"] == 256
        assert 0 < figures["min_us"] <= figures["median_us"] <= figures["p90_us"] <= figures["max_us"]
        assert figures["num_steps"] > 0
    assert cases["decode_256_admit_64"]["num_arriving_per_step"] == 64


def test_scheduler_step_keeps_the_load_constant():
    bench = scheduler_step.StepBench(scheduler_step.CASES[2], num_steps=5, seed=1)
    for _ in range(5):
        bench.timed_step()  # raises unless all 256 + 64 were scheduled
        assert len(bench.scheduler.running) == 256 and not bench.scheduler.waiting
    assert bench.scheduler.counters.preemptions_recompute == 0
