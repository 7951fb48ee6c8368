"""benchmarks/fleet_routing.py without a cluster: the workload's shape and the counter deltas."""

from __future__ import annotations

from benchmarks import fleet_routing
from rayserve_paged.cli import BENCHMARKS


def _args(**overrides):
    args = fleet_routing._parser().parse_args(["--out", "unused"])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def test_each_turn_repeats_the_conversation_so_far_after_a_shared_system_prompt():
    args = _args(systems=2, system_len=16, users=3, turns=3, message_len=4, reply_len=2)
    prompts = fleet_routing.conversations(args)
    assert [len(turns) for turns in prompts] == [3, 3, 3]
    assert [len(p) for p in prompts[0]] == [20, 26, 32]  # system + (message + reply) per earlier turn + message
    for turns in prompts:
        for earlier, later in zip(turns, turns[1:]):
            assert later[: len(earlier)] == earlier
    assert prompts[0][0][:16] == prompts[2][0][:16] != prompts[1][0][:16]  # users 0 and 2 share system 0
    assert prompts[0][0][16:] != prompts[2][0][16:]
    assert fleet_routing.conversations(args) == prompts  # seeded


def test_think_times_are_seeded_exponential_pauses_and_zero_in_the_closed_loop():
    assert fleet_routing.think_times(_args(users=2, turns=3)) == [[0.0] * 3, [0.0] * 3]
    think = fleet_routing.think_times(_args(users=40, turns=5, think_s=2.0))
    assert [len(t) for t in think] == [5] * 40 and all(t > 0 for user in think for t in user)
    assert 1.0 < sum(map(sum, think)) / 200 < 3.0  # mean near 2 s
    assert fleet_routing.think_times(_args(users=40, turns=5, think_s=2.0)) == think  # seeded


def test_counter_deltas_are_summed_by_label():
    before = {"hits": {(("replica", "a"),): 10.0}}
    after = {"hits": {(("replica", "a"),): 25.0, (("replica", "b"),): 4.0}}
    delta = fleet_routing._delta(after, before, "hits")
    assert fleet_routing._by(delta, "replica") == {"a": 15.0, "b": 4.0}
    assert fleet_routing._delta(after, before, "missing") == {}


def test_the_benchmark_is_a_bench_subcommand():
    assert BENCHMARKS["fleet-routing"] == "benchmarks.fleet_routing"
