"""The scheduler's decode fast path changes nothing but speed: the same random worlds run
twice, once as built and once with `fast_decode` off (every group through the general
decode path), and every step's StepMessage, records, preemptions and ignored requests
are identical.

World B replays world A's draws (tokens sampled, which sequence finishes, forks and
aborts), so the two see the same requests as long as their steps agree.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayserve_paged.core import SamplingParams, Sequence, SequenceGroup, SequenceStatus

from .invariants import check_scheduler
from .worlds import make_world

MAX_MODEL_LEN = 96


class World:
    def __init__(self, fast: bool, block_size, num_gpu, num_cpu, mode, caching, chunked, budget) -> None:
        self.s, _ = make_world(
            num_gpu, num_cpu, block_size, caching=caching, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=budget if chunked else MAX_MODEL_LEN, preemption_mode=mode,
            enable_chunked_prefill=chunked,
        )  # fmt: skip
        self.s.fast_decode = fast
        self.ids = itertools.count()

    def add(self, tokens: list[int], best_of: int) -> None:
        seq = Sequence(next(self.ids), tokens)
        index = next(self.ids)
        params = SamplingParams(n=1, best_of=best_of, temperature=1.0)
        self.s.add_group(SequenceGroup(f"r{index}", [seq], params, float(index), index))

    def step(self, choose):
        """One step, then the engine's part: forks on a group's first step, a token per
        sequence, some sequences finish."""
        out = self.s.schedule()
        for group, _, _, do_sample, is_first_step in out.scheduled:
            if not do_sample:
                continue
            if is_first_step:
                for _ in range(group.sampling_params.best_of - 1):
                    self._fork(group, group.seqs[0])
            for seq in group.unfinished_seqs():
                seq.append_token(choose(st.integers(100, 130)))
                if len(seq) >= MAX_MODEL_LEN - 8 or choose(st.integers(0, 7)) == 0:
                    seq.status = SequenceStatus.FINISHED_STOPPED
            self.s.free_finished(group)
        return out

    def fork_or_abort(self, choose) -> None:
        """A running sequence forks (beam-like), or a request is aborted."""
        running = [g for g in self.s.running if g.get_seqs(SequenceStatus.RUNNING)]
        if running and choose(st.booleans()):
            group = running[choose(st.integers(0, len(running) - 1))]
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            self._fork(group, seqs[choose(st.integers(0, len(seqs) - 1))])
        elif self.s.groups:
            request_ids = sorted(self.s.groups)
            assert self.s.abort(request_ids[choose(st.integers(0, len(request_ids) - 1))]) is not None

    def _fork(self, group: SequenceGroup, parent: Sequence) -> None:
        self.s.fork_seq(group, parent, parent.fork(next(self.ids)))


def _step_facts(out) -> tuple:
    records = [(group.request_id, *rest) for group, *rest in out.scheduled]
    return out.message, records, out.preempted, out.ignored, out.num_batched_tokens, out.num_prefill_groups


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(1, 9), min_size=1, max_size=40), st.sampled_from([1, 1, 1, 2, 3])),
        st.just(("step",)),
        st.just(("step",)),
        st.just(("step",)),
        st.just(("fork_or_abort",)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    block_size=st.sampled_from([4, 8, 16]),
    num_gpu=st.integers(6, 30),
    num_cpu=st.integers(0, 12),
    mode=st.sampled_from(["recompute", "swap", "auto"]),
    caching=st.booleans(),
    chunked=st.booleans(),
    budget=st.sampled_from([16, 64, 256]),
    ops=OPS,
    data=st.data(),
)
def test_the_decode_fast_path_emits_the_same_steps(block_size, num_gpu, num_cpu, mode, caching, chunked, budget, ops, data):
    fast, general = (World(f, block_size, num_gpu, num_cpu, mode, caching, chunked, budget) for f in (True, False))
    for op, *args in ops:
        drawn: list = []

        def draw(strategy):
            drawn.append(data.draw(strategy))
            return drawn[-1]

        replay = iter(drawn)
        if op == "add":
            fast.add(*args)
            general.add(*args)
        elif op == "step":
            a = _step_facts(fast.step(draw))
            b = _step_facts(general.step(lambda _: next(replay)))
            assert a == b
        else:
            fast.fork_or_abort(draw)
            general.fork_or_abort(lambda _: next(replay))
        check_scheduler(fast.s)
        check_scheduler(general.s)
    assert fast.s.block_manager.usage() == general.s.block_manager.usage()
