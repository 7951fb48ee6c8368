"""Property-based tests: random adds, steps (with preemption by swap and recompute), forks,
finishes and aborts, with the invariants checked after every operation.

A shadow KV cache plays the workers: it applies each step's swap-out, swap-in and copy
lists, writes every scheduled token into the slot its block table names, and then checks
that every scheduled sequence reads back exactly its own tokens through its block table.
That one check covers copy-on-write, swap mappings and prefix-cache hits.
"""

from __future__ import annotations

import itertools

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from rayserve_paged.core import SamplingParams, Sequence, SequenceGroup, SequenceStatus

from .invariants import check_scheduler
from .machines import SchedulerMachine, machine_test_case
from .views import groups
from .worlds import make_world

PREFIXES = [list(range(10, 50)), list(range(60, 75)), [5] * 33]


class ShadowKV:
    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.gpu: dict[tuple[int, int], int] = {}
        self.cpu: dict[tuple[int, int], int] = {}

    def _copy(self, src, dst, mapping):
        moved = {}
        for s, d in mapping:
            for off in range(self.bs):
                if (s, off) in src:
                    moved[(d, off)] = src[(s, off)]
                else:
                    moved[(d, off)] = None
        for key, tok in moved.items():
            if tok is None:
                dst.pop(key, None)
            else:
                dst[key] = tok

    def apply(self, out, seqs_by_id):
        self._copy(self.gpu, self.cpu, out.message.blocks_to_swap_out)
        self._copy(self.cpu, self.gpu, out.message.blocks_to_swap_in)
        self._copy(self.gpu, self.gpu, out.message.blocks_to_copy)
        for sg in groups(out):
            for ss in sg.seqs:
                for i, tok in enumerate(ss.token_ids):
                    pos = ss.start_pos + i
                    self.gpu[(ss.block_table[pos // self.bs], pos % self.bs)] = tok
        for sg in groups(out):
            for ss in sg.seqs:
                seq = seqs_by_id[ss.seq_id]
                end = ss.start_pos + len(ss.token_ids)
                # a sampling step computes up to the last token; a prefill chunk stops short
                assert end == len(seq) if sg.do_sample else end < len(seq)
                read = [self.gpu.get((ss.block_table[p // self.bs], p % self.bs)) for p in range(end)]
                assert read == seq.token_ids[:end], f"seq {ss.seq_id} reads {read} != {seq.token_ids[:end]}"


class StepMachine(SchedulerMachine):
    policy = "fcfs"  # the scheduling policy (PriorityStepMachine: "priority")

    @initialize(
        block_size=st.sampled_from([4, 16]),
        num_gpu=st.integers(6, 24),
        num_cpu=st.integers(0, 12),
        mode=st.sampled_from(["recompute", "swap", "auto"]),
        caching=st.booleans(),
    )
    def setup(self, block_size, num_gpu, num_cpu, mode, caching):
        self.s, _ = make_world(
            num_gpu, num_cpu, block_size, caching=caching, policy=self.policy,
            max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128, preemption_mode=mode,
        )  # fmt: skip
        self.shadow = ShadowKV(block_size)
        self.ids = itertools.count()
        self.seqs: dict[int, Sequence] = {}

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        prefix_len=st.integers(0, 40),
        suffix=st.lists(st.integers(100, 120), min_size=1, max_size=20),
        best_of=st.integers(1, 3),
    )
    def add(self, prefix, prefix_len, suffix, best_of):
        tokens = PREFIXES[prefix][:prefix_len] + suffix
        seq = Sequence(next(self.ids), tokens)
        self.seqs[seq.seq_id] = seq
        index = next(self.ids)
        params = SamplingParams(n=1, best_of=best_of, temperature=1.0)
        self.s.add_group(SequenceGroup(f"r{index}", [seq], params, float(index), index))

    @rule(data=st.data())
    def step(self, data):
        out = self.s.schedule()
        self.shadow.apply(out, self.seqs)
        for sg in groups(out):
            if not sg.do_sample:  # a prefill chunk: nothing sampled
                continue
            group = self.s.groups[sg.request_id]
            if sg.is_first_step and group.sampling_params.best_of > 1:
                for _ in range(group.sampling_params.best_of - 1):
                    self._fork(group, group.seqs[0])
            for seq in group.unfinished_seqs():
                seq.append_token(data.draw(st.integers(100, 130)))
                if len(seq) >= 120 or data.draw(st.integers(0, 9)) == 0:
                    seq.status = SequenceStatus.FINISHED_STOPPED
            self.s.free_finished(group)

    @precondition(lambda self: any(g.get_seqs(SequenceStatus.RUNNING) for g in self.s.running))
    @rule(data=st.data())
    def beam_step(self, data):
        """Beam-search style: one running sequence forks, another of its group finishes."""
        candidates = [g for g in self.s.running if g.get_seqs(SequenceStatus.RUNNING)]
        group = data.draw(st.sampled_from(candidates))
        running = group.get_seqs(SequenceStatus.RUNNING)
        parent = data.draw(st.sampled_from(running))
        self._fork(group, parent)
        if len(running) > 1:
            loser = data.draw(st.sampled_from([s for s in running if s is not parent]))
            loser.status = SequenceStatus.FINISHED_STOPPED
            self.s.free_finished(group)

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for request_id in list(self.s.groups):
            self.s.abort(request_id)
        check_scheduler(self.s)
        usage = self.s.block_manager.usage()
        assert usage.gpu_used == 0 and usage.cpu_used == 0, usage
        assert usage.gpu_free + usage.gpu_cached == usage.gpu_total


TestScheduler = machine_test_case(StepMachine, max_examples=150, steps=60)
