"""scheduling_policy "priority": admission and victims by (priority, arrival); with every
priority equal, the same steps as "fcfs", token for token."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from rayserve_paged.core import SequenceStatus
from rayserve_paged.core.sequence import SamplingParams, Sequence, SequenceGroup

from .invariants import check_scheduler
from .machines import machine_test_case
from .test_properties import StepMachine
from .views import groups
from .worlds import finish, make_group, make_world, run_step


def step(s, token=7):
    out = run_step(s, token)
    check_scheduler(s)
    return out


def ids(out) -> list[str]:
    return [g.request_id for g in groups(out)]


def test_an_urgent_request_is_admitted_before_a_flood_of_less_urgent_ones():
    s, _ = make_world(num_gpu=64, max_num_seqs=2, policy="priority")
    flood = [make_group(f"batch{i}", 8, arrival=i, priority=10) for i in range(6)]
    for g in flood:
        s.add_group(g)
    assert ids(step(s)) == ["batch0", "batch1"]  # the seats are taken
    urgent = make_group("urgent", 8, arrival=6, priority=0)
    s.add_group(urgent)
    assert s.waiting[0] is urgent  # ahead of batch2..5, which arrived earlier
    finish(s, flood[0])
    assert ids(step(s)) == ["batch1", "urgent"]  # the first free seat is the urgent one's
    assert [g.request_id for g in s.waiting] == ["batch2", "batch3", "batch4", "batch5"]


def test_fcfs_ignores_priority():
    s, _ = make_world(num_gpu=64, max_num_seqs=2)
    flood = [make_group(f"batch{i}", 8, arrival=i, priority=10) for i in range(4)]
    for g in flood:
        s.add_group(g)
    step(s)
    s.add_group(make_group("urgent", 8, arrival=4, priority=0))
    finish(s, flood[0])
    assert ids(step(s)) == ["batch1", "batch2"]


def test_under_kv_pressure_the_least_urgent_latest_group_is_preempted():
    # 6 blocks, three 31-token prompts (2 blocks each): token 33 needs a third block each
    s, _ = make_world(num_gpu=6, num_cpu=0, preemption_mode="recompute", policy="priority")
    urgent = make_group("urgent", 31, arrival=2, priority=0)  # the latest arrival
    low = make_group("low", 31, arrival=0, priority=10)
    mid = make_group("mid", 31, arrival=1, priority=5)
    for g in (low, mid, urgent):
        s.add_group(g)
    step(s)
    assert s.running == [urgent, mid, low]  # most urgent first: the tail is the next victim
    step(s)
    out = step(s)
    assert out.preempted == ["low"]  # the least urgent, though the oldest
    preempted = []
    for _ in range(30):
        out = step(s)
        preempted += out.preempted
        assert urgent.seqs[0].status is SequenceStatus.RUNNING
    assert preempted[0] == "mid" and "urgent" not in preempted  # urgent ran alone
    assert [g.request_id for g in s.waiting] == ["mid", "low"]  # they come back by priority


def test_a_recomputed_group_waits_in_priority_order():
    s, _ = make_world(num_gpu=4, num_cpu=0, preemption_mode="recompute", policy="priority", max_num_seqs=2)
    a = make_group("a", 31, arrival=0, priority=3)
    b = make_group("b", 31, arrival=1, priority=3)
    for g in (a, b):
        s.add_group(g)
    step(s)
    s.add_group(make_group("late-urgent", 8, arrival=2, priority=1))
    s.add_group(make_group("late-lazy", 8, arrival=3, priority=9))
    step(s)
    out = step(s)  # token 33: b goes back to waiting between the urgent and the lazy one
    assert out.preempted == ["b"]
    assert [g.request_id for g in s.waiting] == ["late-urgent", "b", "late-lazy"]


# ---------------------------------------------------------------- equal priorities: fcfs, step for step

_requests = st.lists(
    st.tuples(st.integers(1, 60), st.integers(1, 3), st.integers(1, 40)),  # prompt length, best_of, max tokens
    min_size=1,
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=_requests, num_gpu=st.integers(6, 16), mode=st.sampled_from(["recompute", "swap", "auto"]),
       priority=st.integers(-3, 3), arrive_every=st.integers(0, 3))  # fmt: skip
def test_equal_priorities_schedule_exactly_as_fcfs(requests, num_gpu, mode, priority, arrive_every):
    worlds = [
        make_world(num_gpu, 8, 4, policy=policy, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                   preemption_mode=mode)[0]  # fmt: skip
        for policy in ("fcfs", "priority")
    ]
    pending = list(enumerate(requests))
    seq_ids = [itertools.count(), itertools.count()]
    for step_index in range(2000):
        if pending and (arrive_every == 0 or step_index % arrive_every == 0):
            index, (length, best_of, max_tokens) = pending.pop(0)
            for s, counter in zip(worlds, seq_ids):
                seq = Sequence(next(counter), list(range(1000 * index, 1000 * index + length)))
                params = SamplingParams(best_of=best_of, max_tokens=max_tokens, priority=priority)
                s.add_group(SequenceGroup(f"r{index}", [seq], params, float(index), index))
        outs = [_play(s, step_index) for s in worlds]
        assert outs[0] == outs[1], f"step {step_index}"
        if not pending and not worlds[0].groups:
            break
    assert not worlds[1].groups


def _play(s, step_index: int):
    """One step, played as the engine would (forks at the first sample, a token per
    sampling sequence, the end at max_tokens); what the step did, as plain data."""
    out = s.schedule()
    check_scheduler(s)
    for sg in groups(out):
        if not sg.do_sample:
            continue
        group = s.groups[sg.request_id]
        params = group.sampling_params
        if sg.is_first_step and params.best_of > 1:
            parent = group.seqs[0]
            for _ in range(params.best_of - 1):
                s.fork_seq(group, parent, parent.fork(10_000 + len(group.seqs) + 100 * parent.seq_id))
        for seq in group.unfinished_seqs():
            seq.append_token(step_index + seq.seq_id)
            if seq.num_output_tokens >= params.max_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH
        s.free_finished(group)
    msg = out.message
    return (
        ids(out), list(out.preempted), list(out.ignored), list(msg.seq_ids), list(msg.token_ids),
        list(msg.start_positions), list(msg.block_table_updates), list(msg.blocks_to_swap_in),
        list(msg.blocks_to_swap_out), list(msg.blocks_to_copy),
    )  # fmt: skip


# ---------------------------------------------------------------- the step machine, under the priority policy


class PriorityStepMachine(StepMachine):
    """StepMachine's rules (the shadow KV reads, liveness, teardown) with mixed priorities."""

    policy = "priority"

    @rule(suffix=st.lists(st.integers(100, 120), min_size=1, max_size=40), priority=st.integers(0, 3),
          best_of=st.integers(1, 3))  # fmt: skip
    def add_with_priority(self, suffix, priority, best_of):
        seq = Sequence(next(self.ids), suffix)
        self.seqs[seq.seq_id] = seq
        index = next(self.ids)
        params = SamplingParams(best_of=best_of, priority=priority)
        self.s.add_group(SequenceGroup(f"p{index}", [seq], params, float(index), index))


TestPriorityScheduler = machine_test_case(PriorityStepMachine, max_examples=40, steps=50)
