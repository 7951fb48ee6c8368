"""Tiny worlds for the core tests: a dozen 16-token blocks and hand-made requests."""

from __future__ import annotations

import itertools

from rayserve_paged.core.block_manager import BlockManager
from rayserve_paged.core.scheduler import Scheduler, SchedulerConfig
from rayserve_paged.core.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

from .views import groups

_seq_ids = itertools.count(1000)
_token_bases = itertools.count(1)


def make_group(request_id: str, tokens, arrival: int = 0, **sampling) -> SequenceGroup:
    """A waiting request; `tokens` is a token list, or a prompt length (then its tokens are
    unlike any other request's, so nothing is a prefix hit by accident)."""
    if isinstance(tokens, int):
        base = next(_token_bases) * 100_000
        token_ids = list(range(base, base + tokens))
    else:
        token_ids = list(tokens)
    seq = Sequence(next(_seq_ids), token_ids)
    params = SamplingParams(**sampling)
    return SequenceGroup(request_id, [seq], params, arrival_time=float(arrival), arrival_index=arrival)


def make_world(num_gpu=12, num_cpu=12, block_size=16, watermark=0.0, caching=True, lora_slots=None, **config):
    bm = BlockManager(block_size, num_gpu, num_cpu, watermark=watermark, enable_prefix_caching=caching)
    config.setdefault("max_num_batched_tokens", 4096)
    config.setdefault("max_model_len", 1024)
    return Scheduler(SchedulerConfig(**config), bm, lora_slots), bm


def run_step(scheduler: Scheduler, token: int = 7, distinct: bool = False):
    """Schedule one step and play the engine: append `token` to each sequence that samples
    (`distinct`: token + the sequence's place in its group, so forks diverge)."""
    out = scheduler.schedule()
    for sg in groups(out):
        if not sg.do_sample:
            continue
        group = scheduler.groups[sg.request_id]
        by_id = {s.seq_id: s for s in group.seqs}
        for ss in sg.seqs:
            by_id[ss.seq_id].append_token(token + ss.sample_index if distinct else token)
    return out


def fork_group(scheduler: Scheduler, group: SequenceGroup, num_children: int) -> list[Sequence]:
    parent = group.seqs[0]
    children = []
    for _ in range(num_children):
        child = parent.fork(next(_seq_ids))
        scheduler.fork_seq(group, parent, child)
        children.append(child)
    return children


def finish(scheduler: Scheduler, group: SequenceGroup, seqs=None) -> None:
    for seq in seqs or group.seqs:
        seq.status = SequenceStatus.FINISHED_STOPPED
    scheduler.free_finished(group)
