"""What the scheduler's state machines share: `self.s` is the scheduler, `self.ids` the
id counter and `self.seqs` every sequence by id (each machine's initialize rule sets them);
forks, an abort rule, and the invariants checked after every rule."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from .invariants import check_scheduler


class SchedulerMachine(RuleBasedStateMachine):
    @precondition(lambda self: self.s.groups)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.s.groups)))
        assert self.s.abort(request_id) is not None
        self.on_abort(request_id)

    def _fork(self, group, parent):
        child = parent.fork(next(self.ids))
        self.seqs[child.seq_id] = child
        self.s.fork_seq(group, parent, child)

    def on_abort(self, request_id: str) -> None:
        """What a machine notes of an aborted request (nothing, by default)."""

    @invariant()
    def consistent(self):
        if hasattr(self, "s"):
            check_scheduler(self.s)


def machine_test_case(machine: type[RuleBasedStateMachine], max_examples: int, steps: int):
    """The machine's TestCase, run `max_examples` times for up to `steps` rules each."""
    machine.TestCase.settings = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return machine.TestCase
