"""The scheduler in tiny worlds: exact victims, swap mappings, budgets, aborts."""

from __future__ import annotations

from rayserve_paged.core import PreemptionMode, SequenceStatus

from .invariants import check_scheduler
from .worlds import finish, fork_group, make_group, make_world, run_step
from .views import groups


def step(s, token=7):
    out = run_step(s, token)
    check_scheduler(s)
    return out


def tables(s, group):
    return [s.block_manager.gpu_tables[seq.seq_id] for seq in group.seqs]


def test_prefill_then_decode_work_items():
    s, bm = make_world()
    a = make_group("a", 20, arrival=0)
    s.add_group(a)
    out = step(s)
    (sg,) = groups(out)
    (ss,) = sg.seqs
    assert (ss.start_pos, len(ss.token_ids), ss.block_table, sg.is_first_step) == (0, 20, [0, 1], True)
    assert out.num_batched_tokens == 20 and out.num_prefill_groups == 1
    out = step(s, token=9)
    (ss,) = groups(out)[0].seqs
    assert (ss.start_pos, ss.token_ids, ss.num_output_tokens) == (20, [7], 1)
    assert out.num_batched_tokens == 1 and not groups(out)[0].is_first_step


def test_running_out_of_blocks_preempts_the_most_recent_group_by_recompute():
    s, bm = make_world(num_gpu=6, num_cpu=0, preemption_mode="recompute")
    a, b, c = (make_group(r, 31, arrival=i) for i, r in enumerate("abc"))
    for g in (a, b, c):
        s.add_group(g)
    step(s)  # admits all three: 2 blocks each
    assert tables(s, a) + tables(s, b) + tables(s, c) == [[0, 1], [2, 3], [4, 5]]
    step(s)  # token 32 still fits the second block of each
    out = step(s)  # token 33 needs a third block: none free, so c (the newest) goes
    assert out.preempted == ["c"]
    assert c.seqs[0].status is SequenceStatus.WAITING and c.seqs[0].num_computed_tokens == 0
    assert list(s.waiting) == [c] and s.running == [a, b]
    # c's blocks were freed tail first, then handed to a and b in that order
    assert tables(s, a) == [[0, 1, 5]] and tables(s, b) == [[2, 3, 4]]
    assert s.counters.preemptions_recompute == 1 and s.counters.preemptions_swap == 0
    out = step(s)
    assert [g.request_id for g in groups(out)] == ["a", "b"]  # c must wait: no free block
    finish(s, a)
    out = step(s)
    assert [g.request_id for g in groups(out)] == ["b", "c"]
    # c is recomputed whole: prompt and the tokens it had generated
    assert len(groups(out)[1].seqs[0].token_ids) == 33


def test_a_group_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    s, bm = make_world(num_gpu=3, num_cpu=0)
    a = make_group("a", 32, arrival=0)
    b = make_group("b", 16, arrival=1)
    s.add_group(a)
    s.add_group(b)
    step(s)  # a: [0, 1], b: [2]
    out = step(s)  # both need a block; b is newest: preempted, a gets b's block
    assert out.preempted == ["b"]
    assert [g.request_id for g in groups(out)] == ["a"]
    assert tables(s, a) == [[0, 1, 2]]


def _wide_world(num_cpu, mode="auto"):
    """a (31 tokens, 2 blocks) then g (17 tokens) forked into 3 sequences; 5 GPU blocks."""
    s, bm = make_world(num_gpu=5, num_cpu=num_cpu, preemption_mode=mode)
    a = make_group("a", 31, arrival=0)
    g = make_group("g", 17, arrival=1, n=3, temperature=1.0)
    s.add_group(a)
    s.add_group(g)
    step(s)  # a: [0, 1]; g: [2, 3]
    fork_group(s, g, 2)  # the engine forks after the first sample: 3 sequences share [2, 3]
    return s, bm, a, g


def test_a_multi_sequence_group_is_swapped_out_whole_and_comes_back_whole():
    s, bm, a, g = _wide_world(num_cpu=4)
    assert tables(s, g) == [[2, 3]] * 3
    out = step(s)  # g's 3 sequences write into shared block 3: 2 copies, 1 free block
    assert out.preempted == ["g"]
    assert out.message.blocks_to_swap_out == [(2, 0), (3, 1)]
    assert all(seq.status is SequenceStatus.SWAPPED for seq in g.seqs)
    assert [bm.cpu_tables[seq.seq_id] for seq in g.seqs] == [[0, 1]] * 3
    assert [bm.cpu.blocks[i].ref_count for i in (0, 1)] == [3, 3]
    assert s.counters.preemptions_swap == 1 and bm.counters.swapped_out_blocks == 2
    d = make_group("d", 4, arrival=2)
    s.add_group(d)
    out = step(s)  # no admission while g is swapped, no swap-in while it does not fit
    assert [grp.request_id for grp in groups(out)] == ["a"] and list(s.waiting) == [d]
    finish(s, a)
    out = step(s)
    # g comes back first; with nothing swapped any more, d is admitted in the same step
    assert [grp.request_id for grp in groups(out)] == ["g", "d"]
    # the prompt's full block 2 is still cached on the GPU: taken back without a copy
    gpu_of = dict(out.message.blocks_to_swap_in)
    assert sorted(gpu_of) == [1]
    # back on the GPU, the three sequences then copy-on-write the shared last block
    assert len(out.message.blocks_to_copy) == 2
    assert all(src == gpu_of[1] for src, _ in out.message.blocks_to_copy)
    assert [t[0] for t in tables(s, g)] == [2] * 3
    assert bm.usage().cpu_used == 0 and bm.usage().gpu_free == 0


def test_auto_falls_back_to_recompute_when_the_cpu_pool_is_full():
    s, bm, a, g = _wide_world(num_cpu=1)
    out = step(s)
    assert out.preempted == ["g"] and out.message.blocks_to_swap_out == []
    assert s.counters.preemptions_recompute == 1 and s.counters.preemptions_swap == 0
    assert list(s.waiting) == [g] and all(seq.status is SequenceStatus.WAITING for seq in g.seqs)
    finish(s, a)
    out = step(s)
    # readmitted whole: the prompt's full block is shared by the three sequences again
    first_blocks = {t[0] for t in tables(s, g)}
    assert len(first_blocks) == 1
    assert bm.gpu.blocks[first_blocks.pop()].ref_count == 3
    (sg,) = groups(out)
    assert [ss.start_pos for ss in sg.seqs] == [16, 16, 16]  # block 0 of the prompt was cached


def test_swap_mode_recomputes_when_swap_space_is_missing():
    s, bm = make_world(num_gpu=2, num_cpu=0, preemption_mode=PreemptionMode.SWAP)
    a = make_group("a", 16, arrival=0)
    b = make_group("b", 16, arrival=1)
    s.add_group(a)
    s.add_group(b)
    step(s)
    out = step(s)
    assert out.preempted == ["b"] and s.counters.preemptions_recompute == 1


def test_a_request_that_can_never_fit_is_ignored_and_the_next_one_runs():
    s, bm = make_world(num_gpu=4, max_model_len=100, max_num_batched_tokens=200, max_num_seqs=8)
    s.add_group(make_group("too-long", 101, arrival=0))
    s.add_group(make_group("too-big", 65, arrival=1))  # 5 blocks > 4 in the pool
    s.add_group(make_group("ok", 10, arrival=2))
    out = step(s)
    assert out.ignored == ["too-long", "too-big"]
    assert [g.request_id for g in groups(out)] == ["ok"]
    assert set(s.groups) == {"ok"}


def test_budgets_limit_admissions():
    s, bm = make_world(max_num_seqs=2, max_num_batched_tokens=1024, max_model_len=1024)
    for i in range(3):
        s.add_group(make_group(f"r{i}", 8, arrival=i))
    assert [g.request_id for g in groups(step(s))] == ["r0", "r1"]
    assert len(s.waiting) == 1
    # without chunked prefill a prompt goes whole or waits
    s, bm = make_world(
        num_gpu=24, max_num_batched_tokens=100, max_model_len=100, max_num_seqs=8, enable_chunked_prefill=False
    )
    s.add_group(make_group("x", 60, arrival=0))
    s.add_group(make_group("y", 60, arrival=1))
    assert [g.request_id for g in groups(step(s))] == ["x"]
    out = step(s)
    assert [g.request_id for g in groups(out)] == ["x", "y"] and out.num_batched_tokens == 61


def test_best_of_counts_toward_max_num_seqs_at_admission():
    s, bm = make_world(max_num_seqs=4)
    s.add_group(make_group("wide", 8, arrival=0, n=2, best_of=3))
    s.add_group(make_group("next", 8, arrival=1, n=2))
    assert [g.request_id for g in groups(step(s))] == ["wide"]


def test_requests_sharing_a_prefix_share_blocks_in_the_same_step():
    s, bm = make_world()
    prefix = list(range(900, 932))
    s.add_group(make_group("a", prefix + [1, 2, 3], arrival=0))
    s.add_group(make_group("b", prefix + [4, 5], arrival=1))
    out = step(s)
    a_seq, b_seq = groups(out)[0].seqs[0], groups(out)[1].seqs[0]
    assert a_seq.block_table == [0, 1, 2] and b_seq.block_table == [0, 1, 3]
    assert b_seq.start_pos == 32 and b_seq.token_ids == [4, 5]
    assert out.num_batched_tokens == 35 + 2
    assert bm.counters.prefix_cache_hits == 32


def test_abort_frees_everything_in_every_state():
    s, bm = make_world(num_gpu=5, num_cpu=4)
    a = make_group("a", 31, arrival=0)
    g = make_group("g", 17, arrival=1, n=3)
    w = make_group("w", 40, arrival=2)
    for grp in (a, g, w):
        s.add_group(grp)
    step(s)
    fork_group(s, g, 2)
    step(s)  # g swapped out, w still waiting
    assert g.seqs[0].status is SequenceStatus.SWAPPED and w.seqs[0].status is SequenceStatus.WAITING
    for rid in ("g", "w", "a"):
        assert s.abort(rid) is not None
        check_scheduler(s)
    assert s.abort("nope") is None
    usage = bm.usage()
    assert usage.gpu_used == 0 and usage.cpu_used == 0
    assert not s.groups and not s.running and not s.swapped and not s.waiting
    assert all(seq.status is SequenceStatus.FINISHED_ABORTED for seq in a.seqs + g.seqs + w.seqs)


def test_duplicate_request_id_is_refused():
    s, _ = make_world()
    s.add_group(make_group("a", 4))
    try:
        s.add_group(make_group("a", 4))
    except ValueError as e:
        assert "request_id" in str(e)
    else:
        raise AssertionError("duplicate request id accepted")


def test_a_recomputed_group_returns_to_its_place_among_the_running():
    # a, b, c run; c (two sequences) is swapped out, then b (one) is recomputed. Once a
    # finishes, c swaps in and b is readmitted in one step: running stays oldest first.
    s, bm = make_world(num_gpu=4, num_cpu=8)
    a = make_group("a", 32, arrival=0)
    b = make_group("b", 16, arrival=1)
    c = make_group("c", 9, arrival=2, n=2)
    for g in (a, b, c):
        s.add_group(g)
    step(s)  # a [0, 1], b [2], c [3]
    fork_group(s, c, 1)
    out = step(s)  # a and b need a block each, c a copy: c is swapped, then b recomputed
    assert out.preempted == ["c", "b"]
    assert c.seqs[0].status is SequenceStatus.SWAPPED and b.seqs[0].status is SequenceStatus.WAITING
    finish(s, a)
    out = step(s)
    assert [g.request_id for g in groups(out)] == ["c", "b"]  # swap-ins go first
    assert [g.request_id for g in s.running] == ["b", "c"]  # but b arrived first


def test_a_sequence_reaching_recompute_at_len_is_prefilled_again_whole():
    """Phi-3 LongRoPE: at 33 tokens (its original length 32 + 1) a sequence whose prompt was
    shorter is re-encoded whole, in the same step, without counting as a preemption; one
    whose prompt was already longer decodes on."""
    s, bm = make_world(caching=False, recompute_at_len=33)  # the engine runs such models without a prefix cache
    short, long = make_group("short", 30, arrival=0), make_group("long", 40, arrival=1)
    for g in (short, long):
        s.add_group(g)
    step(s)  # prefills: short has 31 tokens, long 41
    step(s)  # short 32, long 42
    step(s)  # short 33, long 43
    out = step(s)  # short's next decode would be at 33 tokens: recomputed whole; long decodes
    rows = {sg.request_id: sg.seqs[0] for sg in groups(out)}
    assert (rows["short"].start_pos, len(rows["short"].token_ids)) == (0, 33)
    assert (rows["long"].start_pos, len(rows["long"].token_ids)) == (42, 1)
    assert out.preempted == [] and s.counters.preemptions_recompute == 0
    assert [g.request_id for g in s.running] == ["short", "long"] and not s.waiting
    out = step(s)  # both decode on: 34 tokens is past the length
    assert [(sg.request_id, sg.seqs[0].start_pos) for sg in groups(out)] == [("short", 33), ("long", 43)]


def test_a_swapped_sequence_at_recompute_at_len_is_prefilled_again_instead_of_swapped_in():
    s, bm = make_world(num_gpu=6, num_cpu=8, caching=False, preemption_mode="swap", recompute_at_len=34)
    a, b = make_group("a", 47, arrival=0), make_group("b", 32, arrival=1)  # a's prompt is past the length
    for g in (a, b):
        s.add_group(g)
    step(s)  # a 48 tokens in 3 blocks, b 33 in 2
    step(s)  # a 49, b 34 in 3 blocks: the pool is full
    out = step(s)  # a's token 49 needs a 4th block: b leaves, 34 tokens long
    assert out.preempted == ["b"] and list(s.swapped) == [b] and len(b.seqs[0].token_ids) == 34
    finish(s, a)
    out = step(s)
    assert out.message.blocks_to_swap_in == [] and not s.swapped and bm.usage().cpu_used == 0
    (sg,) = groups(out)
    assert (sg.request_id, sg.seqs[0].start_pos, len(sg.seqs[0].token_ids)) == ("b", 0, 34)
