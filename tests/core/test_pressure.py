"""The scheduler under memory pressure, in tiny worlds: every request ends, a group alone
may use the whole pool, swap-in and recompute keep sharing, ended requests are forgotten."""

from __future__ import annotations

from rayserve_paged.core import SequenceStatus
from rayserve_paged.core.sequence import KV_CACHE_LIMIT

from .invariants import check_scheduler
from .worlds import fork_group, make_group, make_world, run_step
from .views import groups


def step(s, token=7, distinct=False):
    out = run_step(s, token, distinct)
    check_scheduler(s)
    return out


def end_at_length(s, max_len):
    """Play the engine's length stop: sequences that reached max_len finish."""
    for group in list(s.groups.values()):
        for seq in group.seqs:
            if seq.status is SequenceStatus.RUNNING and len(seq) >= max_len:
                seq.status = SequenceStatus.FINISHED_LENGTH
        s.free_finished(group)


def _outgrowing_group(mode):
    """g: one 15-token prompt forked into 2 sequences in a pool of 4 blocks (64 tokens =
    max_model_len). Both grow past the first block; at 33 tokens they would need 5 blocks."""
    s, bm = make_world(num_gpu=4, num_cpu=8, max_model_len=64, preemption_mode=mode)
    g = make_group("g", 15, arrival=0, n=2, temperature=1.0)
    s.add_group(g)
    step(s)  # prefill: [0]
    fork_group(s, g, 1)  # both at 16 tokens, sharing block 0
    return s, bm, g


def _run_outgrowing_group(mode):
    s, bm, g = _outgrowing_group(mode)
    finished_ids = []
    for _ in range(60):
        if not s.has_unfinished_groups():
            break
        out = step(s)
        finished_ids += out.message.finished_request_ids
        assert groups(out), "a step with an unfinished request ran nothing"
        assert not out.ignored and not out.preempted
        end_at_length(s, 64)
    assert not s.has_unfinished_groups()
    parent, child = g.seqs
    # at 33 tokens the two need 1 shared + 2 + 2 blocks: the child ends, the pool is the limit
    assert (child.status, child.stop_reason, len(child)) == (SequenceStatus.FINISHED_LENGTH, KV_CACHE_LIMIT, 33)
    assert (parent.status, parent.stop_reason, len(parent)) == (SequenceStatus.FINISHED_LENGTH, None, 64)
    finished_ids += s.schedule().message.finished_request_ids
    assert finished_ids == ["g"]  # the workers are told to forget it
    usage = bm.usage()
    assert usage.gpu_used == 0 and usage.cpu_used == 0


def test_a_group_outgrowing_the_pool_alone_ends_sequences_instead_of_hanging_in_swap():
    _run_outgrowing_group("swap")


def test_a_group_outgrowing_the_pool_alone_is_not_refused_after_recompute():
    _run_outgrowing_group("recompute")


def test_a_group_alone_may_use_the_whole_pool_despite_the_watermark():
    # the watermark keeps 1 of 4 blocks free, but a request alone may take all of them
    s, bm = make_world(num_gpu=4, num_cpu=0, watermark=0.25, max_model_len=64)
    a = make_group("a", 63, arrival=0)
    s.add_group(a)
    out = step(s)
    assert not out.ignored and [g.request_id for g in groups(out)] == ["a"]
    assert bm.gpu_tables[a.seqs[0].seq_id] == [0, 1, 2, 3]


def _two_then_alone(mode, num_cpu):
    """In a pool of exactly max_model_len (4 blocks, the watermark keeps 1 free at
    admission): c has a 32-token prompt, b the same 32 tokens + 15. b shares c's two blocks
    and is admitted; at 49 tokens it needs a 4th block, none is free, b (the newest) is
    preempted. Once c ends, b alone may use the whole pool: it comes back and runs on."""
    s, bm = make_world(num_gpu=4, num_cpu=num_cpu, watermark=0.25, max_model_len=64, preemption_mode=mode)
    prefix = list(range(900, 932))
    c = make_group("c", prefix, arrival=0)
    b = make_group("b", prefix + list(range(15)), arrival=1)
    s.add_group(c)
    s.add_group(b)
    preempted = []
    for _ in range(80):
        if not s.has_unfinished_groups():
            break
        out = step(s)
        assert groups(out) and not out.ignored
        preempted += out.preempted
        if len(c.seqs[0]) >= 40 and not c.seqs[0].is_finished:
            c.seqs[0].status = SequenceStatus.FINISHED_STOPPED
            s.free_finished(c)
        end_at_length(s, 64)
    assert preempted == ["b"]
    assert b.seqs[0].status is SequenceStatus.FINISHED_LENGTH and len(b.seqs[0]) == 64
    assert bm.usage().gpu_used == 0 and bm.usage().cpu_used == 0


def test_a_long_request_preempted_by_recompute_comes_back_whatever_the_watermark():
    _two_then_alone("recompute", num_cpu=0)


def test_a_long_request_swapped_out_comes_back_whatever_the_watermark():
    _two_then_alone("swap", num_cpu=8)


def test_swap_in_reuses_prompt_blocks_still_on_the_gpu():
    # c (32 tokens) and a, g sharing a 32-token prefix; g (n=2) is the newest: swapped out
    # while a still holds the prefix blocks, which g gets back without a copy.
    s, bm = make_world(num_gpu=8, num_cpu=8, preemption_mode="swap")
    prefix = list(range(900, 932))
    c = make_group("c", 32, arrival=0)
    a = make_group("a", prefix + [1], arrival=1)
    g = make_group("g", prefix + [2], arrival=2, n=2, temperature=1.0)
    for grp in (c, a, g):
        s.add_group(grp)
    step(s)  # c [0, 1]; a [2, 3, 4]; g hits [2, 3] + [5]
    fork_group(s, g, 1)
    assert [bm.gpu_tables[q.seq_id] for q in g.seqs] == [[2, 3, 5]] * 2
    while True:
        out = step(s, distinct=True)  # the two sequences of g diverge
        if out.preempted:
            break
    assert out.preempted == ["g"] and g.seqs[0].status is SequenceStatus.SWAPPED
    assert out.message.blocks_to_swap_out == [(2, 0), (3, 1), (7, 2), (5, 3)]
    assert [bm.cpu_tables[q.seq_id] for q in g.seqs] == [[0, 1, 2], [0, 1, 3]]
    assert bm.gpu_tables[a.seqs[0].seq_id] == [2, 3, 4, 7]  # a took g's block 7; 5 stays cached
    for seq in c.seqs:
        seq.status = SequenceStatus.FINISHED_STOPPED
    s.free_finished(c)
    out = step(s, distinct=True)
    assert [grp.request_id for grp in groups(out)] == ["a", "g"]
    # one copy: the prefix blocks a holds (2, 3) and g's still-cached block 5 are taken as
    # they are; only CPU block 2 (whose GPU copy a now holds) travels back
    assert out.message.blocks_to_swap_in == [(2, 6)]
    assert [bm.gpu_tables[q.seq_id] for q in g.seqs] == [[2, 3, 6, 1], [2, 3, 5, 0]]
    assert bm.gpu.blocks[2].ref_count == 3 and bm.counters.swapped_in_blocks == 1


def test_recompute_of_a_group_shares_the_prompt_and_reuses_each_sequences_cached_blocks():
    # g: a 40-token prompt (2 full blocks) forked into 3 diverging sequences, recomputed
    # after a preemption; back in, all three share the prompt's blocks, and each takes its
    # own cached full block back: only each one's last token is computed again.
    s, bm = make_world(num_gpu=9, num_cpu=0, preemption_mode="recompute")
    a = make_group("a", 47, arrival=0)
    g = make_group("g", 40, arrival=1, n=3, temperature=1.0)
    s.add_group(a)
    s.add_group(g)
    step(s)  # a [0, 1, 2]; g [3, 4, 5]
    fork_group(s, g, 2)
    while True:
        out = step(s, distinct=True)
        if out.preempted:
            break
    assert out.preempted == ["g"] and all(q.status is SequenceStatus.WAITING for q in g.seqs)
    assert [len(q) for q in g.seqs] == [49, 49, 49]
    a.seqs[0].status = SequenceStatus.FINISHED_STOPPED
    s.free_finished(a)
    out = step(s)
    (sg,) = groups(out)
    assert [bm.gpu_tables[q.seq_id] for q in g.seqs] == [[3, 4, 6, 8], [3, 4, 7, 2], [3, 4, 5, 1]]
    assert bm.gpu.blocks[3].ref_count == bm.gpu.blocks[4].ref_count == 3
    assert [(ss.start_pos, len(ss.token_ids)) for ss in sg.seqs] == [(48, 1)] * 3
    assert out.num_batched_tokens == 3


def test_a_request_ended_after_running_releases_its_sampling_parameters():
    # b runs, is preempted, comes back, and at 49 tokens cannot grow even alone (the pool
    # holds 48 tokens, less than max_model_len, as no engine would start with): it ends, and
    # its id must still reach the workers' finished list.
    s, bm = make_world(num_gpu=3, num_cpu=0, max_model_len=100, preemption_mode="recompute")
    a = make_group("a", 16, arrival=0)
    b = make_group("b", 30, arrival=1)
    s.add_group(a)
    s.add_group(b)
    seen, ignored = [], []
    for _ in range(80):
        if not s.has_unfinished_groups():
            break
        out = step(s)
        seen += out.message.finished_request_ids
        ignored += out.ignored
        end_at_length(s, 48 if a.seqs[0].status is SequenceStatus.RUNNING else 100)
    seen += s.schedule().message.finished_request_ids
    assert ignored == ["b"] and len(b.seqs[0]) == 49
    assert (b.seqs[0].status, b.seqs[0].stop_reason) == (SequenceStatus.FINISHED_LENGTH, KV_CACHE_LIMIT)
    assert sorted(seen) == ["a", "b"]
