"""Chunked prefill in tiny worlds: the exact chunk schedule under one token budget."""

from __future__ import annotations

from rayserve_paged.core import SequenceStatus

from .invariants import check_scheduler
from .worlds import finish, fork_group, make_group, make_world, run_step
from .views import groups


def step(s):
    out = run_step(s)
    check_scheduler(s)
    return out


def work(out):
    """(request id, start position, tokens computed, samples?) per scheduled group."""
    return [(g.request_id, g.seqs[0].start_pos, len(g.seqs[0].token_ids), g.do_sample) for g in groups(out)]


def test_decodes_first_then_prompt_chunks_in_arrival_order():
    s, bm = make_world(num_gpu=24, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    s.add_group(make_group("d", 5, arrival=0))
    assert work(step(s)) == [("d", 0, 5, True)]
    s.add_group(make_group("a", 30, arrival=1))
    s.add_group(make_group("b", 10, arrival=2))
    # d decodes (1 token); a gets the remaining 15; b waits for budget
    assert work(step(s)) == [("d", 5, 1, True), ("a", 0, 15, False)]
    # a's second chunk stops short of its last token? no: 15 left fit in 15 -> a samples
    assert work(step(s)) == [("d", 6, 1, True), ("a", 15, 15, True)]
    # now a decodes too; b's 10 tokens fit in what is left (16 - 2)
    assert work(step(s)) == [("d", 7, 1, True), ("a", 30, 1, True), ("b", 0, 10, True)]
    assert step(s).num_batched_tokens == 3


def test_a_chunk_never_samples_and_blocks_are_cached_only_once_computed():
    s, bm = make_world(num_gpu=24, max_num_batched_tokens=20, max_num_seqs=4, max_model_len=256)
    prompt = list(range(500, 550))  # 50 tokens: chunks of 20, 20, 10
    s.add_group(make_group("a", prompt, arrival=0))
    out = step(s)
    assert work(out) == [("a", 0, 20, False)]
    assert len(bm.gpu.cached) == 1  # block 0 computed; block 1 only partly
    # a request with the same prompt admitted now can only hit what is computed
    s.add_group(make_group("b", prompt, arrival=1))
    out = step(s)
    assert work(out) == [("a", 20, 20, False)]  # the budget went to a
    assert len(bm.gpu.cached) == 2
    out = step(s)
    # a's last chunk registers block 2 as it is scheduled: b, admitted after it in the same
    # step, hits blocks 0-2 and computes only its last 2 tokens
    assert work(out) == [("a", 40, 10, True), ("b", 48, 2, True)]
    assert groups(out)[1].seqs[0].block_table[:3] == groups(out)[0].seqs[0].block_table[:3]
    a = s.groups["a"]
    assert a.seqs[0].num_output_tokens == 1 and s.groups["b"].seqs[0].num_output_tokens == 1


def _preempted_mid_prefill(mode):
    """a (44 tokens) prefills in chunks of 8, then decodes; b (40 tokens) gets what a leaves
    of each step's budget and has 32 tokens computed when a needs a 4th block: b, partly
    prefilled, is preempted."""
    s, bm = make_world(num_gpu=6, num_cpu=8, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=96, preemption_mode=mode)
    s.add_group(make_group("a", 44, arrival=0))
    s.add_group(make_group("b", 40, arrival=1))
    schedule = [work(step(s)) for _ in range(11)]
    assert schedule[:5] == [[("a", 8 * i, 8, False)] for i in range(5)]
    assert schedule[5] == [("a", 40, 4, True), ("b", 0, 4, False)]
    assert schedule[6:10] == [[("a", 44 + i, 1, True), ("b", 4 + 7 * i, 7, False)] for i in range(4)]
    assert schedule[10] == [("a", 48, 1, True)]
    b = s.groups["b"]
    return s, bm, b


def test_a_partly_prefilled_request_preempted_by_recompute_starts_over_from_its_cached_blocks():
    s, bm, b = _preempted_mid_prefill("recompute")
    assert b.seqs[0].status is SequenceStatus.WAITING and b.seqs[0].num_computed_tokens == 0
    finish(s, s.groups["a"])
    # b's two computed full blocks (tokens 0-31) are still cached: it restarts at 32
    assert work(step(s)) == [("b", 32, 8, True)]


def test_a_partly_prefilled_request_swapped_out_resumes_where_it_stopped():
    s, bm, b = _preempted_mid_prefill("swap")
    assert b.seqs[0].status is SequenceStatus.SWAPPED and b.seqs[0].num_computed_tokens == 32
    finish(s, s.groups["a"])
    out = step(s)
    assert work(out) == [("b", 32, 8, True)] and len(out.message.blocks_to_swap_in) + len(out.message.blocks_to_copy) <= 3
    assert work(step(s)) == [("b", 40, 1, True)]


def test_a_request_aborted_mid_prefill_frees_its_blocks_and_is_forgotten():
    s, bm = make_world(num_gpu=6, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=96)
    s.add_group(make_group("a", 30, arrival=0))
    assert work(step(s)) == [("a", 0, 8, False)]
    assert s.abort("a") is not None
    check_scheduler(s)
    assert bm.usage().gpu_used == 0
    assert step(s).message.finished_request_ids == ["a"]


# ---------------------------------------------------------------------------- wide groups


def _budget_holds(out, s) -> None:
    msg = out.message
    assert len(msg.seq_ids) <= s.config.max_num_seqs
    assert sum(msg.num_query_tokens) <= s.config.max_num_batched_tokens


def test_a_group_still_prefilling_counts_at_its_full_width():
    """A 40-token prompt with n=4 prefilled in chunks beside short prompts: while it
    prefills it holds 4 of max_num_seqs = 4 (it forks to 4 when it samples), so the short
    prompts wait; no step schedules more than 4 sequences or 32 tokens, and the pool of 12
    blocks never runs dry."""
    s, bm = make_world(num_gpu=12, num_cpu=0, block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
                       max_model_len=96)  # fmt: skip
    wide = make_group("wide", 40, arrival=0, n=4, temperature=1.0)
    short = [make_group(f"s{i}", 8, arrival=1 + i, temperature=0.0) for i in range(3)]
    for g in (wide, *short):
        s.add_group(g)
    out = run_step(s)  # the first chunk
    assert [sg.request_id for sg in groups(out)] == ["wide"] and sum(out.message.num_query_tokens) == 32
    out = run_step(s)  # the rest of the prompt; the short ones cannot join: 4 of 4 are taken
    assert [sg.request_id for sg in groups(out)] == ["wide"] and list(s.waiting) == short
    fork_group(s, wide, 3)
    for _ in range(30):
        out = run_step(s, distinct=True)
        _budget_holds(out, s)
        assert sum(g.max_num_running_seqs() for g in s.running) <= 4
        check_scheduler(s)


def test_a_swapped_group_that_was_prefilling_comes_back_at_its_full_width():
    s, _ = make_world(num_gpu=12, num_cpu=12, block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
                      max_model_len=96, preemption_mode="swap")  # fmt: skip
    old = make_group("old", 8, arrival=0, temperature=0.0)
    wide = make_group("wide", 40, arrival=1, best_of=3, n=1, temperature=1.0)
    s.add_group(old)
    s.add_group(wide)
    run_step(s)  # old's prompt and wide's first chunk
    out = s.schedule()
    s._preempt(s.running.pop(), out)  # wide, mid-prefill, goes to the CPU pool
    assert wide.seqs[0].status is SequenceStatus.SWAPPED and wide.is_prefilling
    s.add_group(make_group("late", 8, arrival=2, n=2, temperature=1.0))
    for _ in range(6):
        out = run_step(s)
        _budget_holds(out, s)
        assert sum(g.max_num_running_seqs() for g in s.running) <= 4
    assert wide in s.running


def test_without_chunking_a_recomputed_wide_group_stays_within_the_budget():
    """Chunked prefill off: a prompt goes whole, but a recomputed group of several
    sequences longer than one step's budget together is prefilled over several steps."""
    s, _ = make_world(num_gpu=40, num_cpu=0, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=64, enable_chunked_prefill=False, caching=False)  # fmt: skip
    wide = make_group("wide", 50, arrival=0, n=4, temperature=1.0)
    s.add_group(wide)
    run_step(s)
    fork_group(s, wide, 3)
    for _ in range(5):
        run_step(s, distinct=True)
    out = s.schedule()
    s._preempt(s.running.pop(), out)  # recompute: 4 x 56 tokens to prefill again
    # 55 tokens of the first sequence, then 8 of each other one past the 6 prompt blocks they
    # share: 79 tokens, more than the budget of 64 -> two steps, the first one full
    first = run_step(s, distinct=True)
    assert list(zip(first.message.seq_ids, first.message.start_positions, first.message.num_query_tokens)) == [
        (wide.seqs[0].seq_id, 0, 55), (wide.seqs[1].seq_id, 48, 7), (wide.seqs[2].seq_id, 48, 2)
    ]  # fmt: skip
    assert [g.do_sample for g in groups(first)] == [False]
    second = run_step(s, distinct=True)
    assert sum(second.message.num_query_tokens) == 16 and [g.do_sample for g in groups(second)] == [True]
