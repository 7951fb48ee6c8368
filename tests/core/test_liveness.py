"""Liveness as a property: random mixes of single requests, parallel samples (n / best_of)
and beam-like groups, in pools from exactly one max_model_len sequence up, block sizes
8/16/32, every preemption mode, CPU pools from 0 blocks, chunked prefill on or off, aborts,
and requests on four LoRA adapters competing for one or two device slots (or no LoRA).

After every step: the blocks are accounted for exactly (the invariants); while any request
is unfinished the step scheduled something (bound: 1 step: the oldest running group always
runs, else the head of swapped or waiting does); nothing is refused as "never fits"; every
request whose parameters reached the workers is later in their finished list. At the end
every request has ended (within a bounded number of steps), both pools are empty and no
adapter slot is pinned; throughout, the pins are exactly the running and swapped groups'.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from rayserve_paged.core import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from rayserve_paged.core.lora import LoRARequest, LoRASlots

from .invariants import check_scheduler
from .machines import SchedulerMachine
from .test_properties import ShadowKV
from .views import groups
from .worlds import make_world

MAX_MODEL_LEN = 64
LORAS = [LoRARequest(f"lora-{i}", i, f"/adapters/{i}") for i in range(1, 5)]


class LivenessMachine(SchedulerMachine):
    @initialize(
        block_size=st.sampled_from([8, 16, 32]),
        extra_blocks=st.integers(0, 6),
        num_cpu=st.integers(0, 10),
        mode=st.sampled_from(["recompute", "swap", "auto"]),
        chunked=st.booleans(),
        budget=st.sampled_from([8, 16, 64]),
        watermark=st.sampled_from([0.0, 0.1]),
        caching=st.booleans(),
        max_loras=st.sampled_from([0, 1, 2]),
    )
    def setup(self, block_size, extra_blocks, num_cpu, mode, chunked, budget, watermark, caching, max_loras):
        num_gpu = -(-MAX_MODEL_LEN // block_size) + extra_blocks  # from exactly max_model_len up
        if not chunked:
            budget = MAX_MODEL_LEN
        self.s, _ = make_world(
            num_gpu, num_cpu, block_size, watermark=watermark, caching=caching, max_num_seqs=8,
            max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN, preemption_mode=mode,
            enable_chunked_prefill=chunked, lora_slots=LoRASlots(max_loras) if max_loras else None,
        )
        self.shadow = ShadowKV(block_size)
        self.ids = itertools.count()
        self.seqs: dict[int, Sequence] = {}
        self.params_sent: set[str] = set()
        self.released: list[str] = []
        self.aborted: set[str] = set()

    @rule(
        prompt=st.lists(st.integers(1, 6), min_size=1, max_size=MAX_MODEL_LEN - 1),
        kind=st.sampled_from(["single", "n", "best_of", "beam"]),
        width=st.integers(2, 3),
        max_tokens=st.integers(1, 40),
        adapter=st.integers(0, 4),
    )
    def add(self, prompt, kind, width, max_tokens, adapter):
        seq = Sequence(next(self.ids), prompt)
        self.seqs[seq.seq_id] = seq
        index = next(self.ids)
        if kind == "single":
            params = SamplingParams(max_tokens=max_tokens)
        elif kind == "n":
            params = SamplingParams(n=width, max_tokens=max_tokens)
        elif kind == "best_of":
            params = SamplingParams(n=1, best_of=width, max_tokens=max_tokens)
        else:
            params = SamplingParams(n=width, use_beam_search=True, temperature=0.0, max_tokens=max_tokens)
        lora = LORAS[adapter - 1] if adapter and self.s.lora_slots is not None else None
        self.s.add_group(SequenceGroup(f"r{index}", [seq], params, float(index), index, lora))

    def _step(self, draw):
        had_work = self.s.has_unfinished_groups()
        out = self.s.schedule()
        self.released += out.message.finished_request_ids
        assert not out.ignored, f"refused as never fits: {out.ignored}"
        if had_work:
            assert groups(out), "a step with unfinished requests scheduled nothing"
        self.shadow.apply(out, self.seqs)
        for sg in groups(out):
            if sg.sampling_params is not None:
                self.params_sent.add(sg.request_id)
            if not sg.do_sample:
                continue
            group = self.s.groups[sg.request_id]
            params = group.sampling_params
            if sg.is_first_step and params.best_of > 1:
                for _ in range(params.best_of - 1):
                    self._fork(group, group.seqs[0])
            elif params.use_beam_search and draw(st.integers(0, 1)) == 1:
                # beam-like: a running beam forks, another one is dropped
                running = group.get_seqs(SequenceStatus.RUNNING)
                if len(running) > 1:
                    running[-1].status = SequenceStatus.FINISHED_ABORTED
                    self._fork(group, running[0])
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.append_token(draw(st.integers(1, 6)))
                if len(seq) >= MAX_MODEL_LEN or seq.num_output_tokens >= params.max_tokens:
                    seq.status = SequenceStatus.FINISHED_LENGTH
            self.s.free_finished(group)

    @rule(data=st.data())
    def step(self, data):
        self._step(data.draw)

    def on_abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    @invariant()
    def lora_pins(self):
        if hasattr(self, "s"):
            self._check_lora_pins()

    def _check_lora_pins(self):
        slots = self.s.lora_slots
        if slots is None:
            return
        pinned = [g for g in self.s.groups.values() if g.has_lora_slot]
        assert all(g in self.s.running or g in self.s.swapped for g in pinned)
        assert all(g.has_lora_slot for g in (*self.s.running, *self.s.swapped) if g.lora_request and not g.is_finished())
        counts: dict[tuple, int] = {}
        for g in pinned:
            counts[g.lora_key] = counts.get(g.lora_key, 0) + 1
        assert counts == slots.num_pins
        assert len(slots.slot_of) <= slots.max_loras and set(slots.num_pins) <= set(slots.slot_of)

    def teardown(self):
        if not hasattr(self, "s"):
            return
        # every request ends on its own: no request can need more steps than its prefill
        # (at most max_model_len chunks of 1 token) plus max_model_len decodes, times the
        # requests queued ahead of it
        bound = 2 * MAX_MODEL_LEN * (len(self.s.groups) + 1) + 10
        tokens = itertools.cycle([1, 2, 3, 4, 5, 6])
        for _ in range(bound):
            if not self.s.has_unfinished_groups():
                break
            self._step(lambda strategy: next(tokens))
            check_scheduler(self.s)
        assert not self.s.has_unfinished_groups(), f"requests still unfinished after {bound} steps"
        self.released += self.s.schedule().message.finished_request_ids
        assert sorted(self.released) == sorted(self.params_sent), "workers would keep ended requests' params"
        usage = self.s.block_manager.usage()
        assert usage.gpu_used == 0 and usage.cpu_used == 0, usage
        assert self.s.lora_slots is None or self.s.lora_slots.num_pins == {}


LivenessMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
TestLiveness = LivenessMachine.TestCase
