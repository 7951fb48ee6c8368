"""The step message carries what changed, not what the workers already hold: exact rows,
exact block-table updates, parameters once, no per-sequence token history."""

from __future__ import annotations

import pickle

from rayserve_paged.core import SequenceStatus
from tests.core.worlds import finish, fork_group, make_group, make_world, run_step


def _decoding_world(num_running: int, prompt_len: int):
    """`num_running` single-sequence requests, prefilled and sampled once: all decode next."""
    s, bm = make_world(num_gpu=num_running * (prompt_len // 16 + 2), num_cpu=0, max_num_seqs=num_running, max_model_len=4096,
                       max_num_batched_tokens=num_running * prompt_len)
    for i in range(num_running):
        s.add_group(make_group(f"r{i}", prompt_len, arrival=i, temperature=0.0, max_tokens=None))
    run_step(s)  # prefill everything, one token sampled each
    assert len(s.running) == num_running
    return s, bm


def test_256_decodes_carry_one_token_per_sequence_and_no_history():
    s, _ = _decoding_world(256, prompt_len=20)  # 21 tokens each: position 20 is in block 1
    out = s.schedule()
    msg = out.message
    seqs = [g.seqs[0] for g in s.running]
    assert msg.seq_ids == [q.seq_id for q in seqs]
    assert msg.start_positions == [20] * 256
    assert msg.num_query_tokens == [1] * 256
    assert msg.token_ids == [q.token_ids[-1] for q in seqs]
    # nothing else: no parameters, no tables (no block boundary crossed), no history
    assert msg.new_requests == [] and msg.block_table_updates == [] and msg.forks == []
    assert msg.freed_seq_ids == [] and msg.finished_request_ids == [] and msg.blocks_to_copy == []
    assert msg.unsampled_seq_ids == [] and msg.first_step_seq_ids == []


def test_the_message_does_not_grow_with_the_sequences_history():
    sizes = []
    for prompt_len in (20, 500):  # both decode inside a block (20 % 16, 500 % 16 != 0)
        s, _ = _decoding_world(64, prompt_len=prompt_len)
        run_step(s)
        sizes.append(len(pickle.dumps(s.schedule().message)))
    # only the token values and positions differ (ints pickle in 1, 2 or 4 bytes)
    assert abs(sizes[1] - sizes[0]) <= 64 * 3, sizes


def test_parameters_go_once_with_the_prompt_only_when_penalties_need_it():
    s, _ = make_world()
    s.add_group(make_group("plain", 20, arrival=0))
    s.add_group(make_group("penalised", [5, 6, 7], arrival=1, presence_penalty=0.5))
    first = s.schedule().message
    assert [(r.request_id, r.num_prompt_tokens, r.prompt_token_ids) for r in first.new_requests] == [
        ("plain", 20, None),
        ("penalised", 3, [5, 6, 7]),
    ]
    assert first.first_step_seq_ids == first.seq_ids  # both sample for the first time
    for group in s.running:
        group.seqs[0].append_token(9)
    assert s.schedule().message.new_requests == []


def test_block_table_updates_name_only_the_new_blocks():
    s, bm = make_world(num_gpu=12, num_cpu=0)
    s.add_group(make_group("a", 15, arrival=0))
    msg = s.schedule().message
    seq = s.running[0].seqs[0]
    assert msg.block_table_updates == [(seq.seq_id, 0, [0])]
    seq.append_token(7)  # 16 tokens: position 15 is the last slot of block 0
    assert s.schedule().message.block_table_updates == []
    seq.append_token(7)  # position 16 opens block 1
    msg = s.schedule().message
    assert msg.block_table_updates == [(seq.seq_id, 1, [1])]
    assert bm.get_block_table(seq) == [0, 1]


def test_forks_and_copy_on_write_update_the_workers_tables():
    s, bm = make_world(num_gpu=12, num_cpu=0)
    group = make_group("n2", 20, arrival=0, n=2, temperature=1.0)
    s.add_group(group)
    s.schedule()
    parent = group.seqs[0]
    (child,) = fork_group(s, group, 1)
    parent.append_token(7)
    child.append_token(8)
    msg = s.schedule().message
    assert msg.forks == [(parent.seq_id, child.seq_id, 1)]
    # both wrote into the shared last block: the first to write copies it (copy-on-write)
    assert bm.get_block_table(parent) == [0, 2] and bm.get_block_table(child) == [0, 1]
    assert msg.blocks_to_copy == [(1, 2)]
    assert msg.block_table_updates == [(parent.seq_id, 1, [2])]
    assert msg.seq_ids == [parent.seq_id, child.seq_id] and msg.token_ids == [7, 8]


def test_a_sequence_that_ends_before_its_request_is_freed_on_the_workers():
    s, _ = make_world()
    group = make_group("n2", 20, arrival=0, n=2, temperature=1.0)
    s.add_group(group)
    run_step(s)
    parent = group.seqs[0]
    (child,) = fork_group(s, group, 1)
    finish(s, group, [child])
    msg = s.schedule().message
    assert msg.forks == [(parent.seq_id, child.seq_id, 1)] and msg.freed_seq_ids == [child.seq_id]
    assert msg.seq_ids == [parent.seq_id]
    finish(s, group)
    assert s.schedule().message.finished_request_ids == ["n2"]


def test_swap_in_resends_the_whole_table():
    s, bm = make_world(num_gpu=4, num_cpu=8, preemption_mode="swap")
    old = make_group("old", 30, arrival=0, n=2, temperature=1.0)
    new = make_group("new", 30, arrival=1, n=2, temperature=1.0)
    s.add_group(old)
    s.add_group(new)
    run_step(s)  # both prefill (2 blocks each)
    for group in (old, new):
        fork_group(s, group, 1)
    run_step(s, distinct=True)  # copy-on-write of the shared last blocks preempts "new"
    assert new.seqs[0].status is SequenceStatus.SWAPPED
    finish(s, old)
    msg = s.schedule().message  # "new" comes back into other blocks
    assert msg.blocks_to_swap_in
    updates = {seq_id: (start, blocks) for seq_id, start, blocks in msg.block_table_updates}
    for seq in new.seqs:
        assert updates[seq.seq_id] == (0, bm.get_block_table(seq))


def test_a_sequence_that_ends_while_its_group_waits_for_recompute_is_freed_on_the_workers():
    s, bm = make_world(num_gpu=4, num_cpu=0, preemption_mode="recompute")
    old = make_group("old", 30, arrival=0, temperature=0.0)
    wide = make_group("wide", 30, arrival=1, n=2, temperature=1.0)
    s.add_group(old)
    s.add_group(wide)
    run_step(s)  # both prefill (2 blocks each)
    (child,) = fork_group(s, wide, 1)
    run_step(s, distinct=True)  # the fork's copy-on-write needs a fifth block: "wide" is recomputed
    assert all(seq.status is SequenceStatus.WAITING and not bm.has_blocks(seq) for seq in wide.seqs)
    finish(s, wide, [child])  # ends (a stop string, say) while its group holds no blocks
    msg = s.schedule().message
    assert msg.freed_seq_ids == [child.seq_id]
    finish(s, wide, [child])  # released once
    assert child.seq_id not in s.schedule().message.freed_seq_ids


def test_is_empty_reads_every_field():
    from dataclasses import fields

    from rayserve_paged.core.outputs import NewRequest, StepMessage
    from rayserve_paged.core.sequence import SamplingParams

    assert StepMessage().is_empty
    samples = {
        "finished_request_ids": ["r"],
        "new_requests": [NewRequest("r", 1, SamplingParams(), 3)],
        "forks": [(1, 2, 1)],
        "freed_seq_ids": [2],
        "block_table_updates": [(1, 0, [4])],
        "blocks_to_swap_out": [(1, 2)],
        "blocks_to_swap_in": [(2, 1)],
        "blocks_to_copy": [(1, 3)],
        "seq_ids": [1],
        "start_positions": [0],
        "num_query_tokens": [1],
        "token_ids": [7],
        "unsampled_seq_ids": [1],
        "first_step_seq_ids": [1],
        "draft_seq_ids": [1],
        "num_draft_tokens": [2],
        "bitmask_seq_ids": [1],
        "token_bitmasks": b"\xff\xff\xff\xff",
        "lora_slot_updates": [(0, (1, "/adapters/a", "digest"))],
        "lora_forgets": [(1, "/adapters/a", "digest")],
    }
    assert set(samples) == {f.name for f in fields(StepMessage)}
    for name, value in samples.items():
        assert not StepMessage(**{name: value}).is_empty, name
