"""Blocks wholly before the sliding window go back to the pool (all-windowed models): exact
tables, free counts, the bound ceil(window / block_size) + 1, forks, swap and recompute."""

from __future__ import annotations

import pytest

from rayserve_paged.core import BlockManager, SequenceStatus
from rayserve_paged.core.block_manager import NULL_BLOCK

from .invariants import check_block_manager
from .test_block_manager import admit, decode
from .worlds import make_group


@pytest.mark.parametrize("block_size, window", [(4, 8), (4, 6), (8, 5), (16, 40)])
def test_a_long_generation_holds_at_most_ceil_window_over_block_plus_one(block_size, window):
    bm = BlockManager(block_size, 64, 8, sliding_window=window)
    group = make_group("a", 5)
    admit(bm, group)
    seq = group.seqs[0]
    held = []
    for _ in range(4 * window):
        decode(bm, seq)
        n = len(seq)  # the step computes position n - 1: it sees positions >= n - window
        live = [i for i, bid in enumerate(bm.get_block_table(seq)) if bid != NULL_BLOCK]
        assert live == list(range(max(0, n - window) // block_size, -(-n // block_size)))
        assert bm.num_held_blocks(seq) == len(live) == 64 - bm.num_free_gpu_blocks()
        held.append(len(live))
    assert max(held) == -(-window // block_size) + 1
    bm.free(seq)
    check_block_manager(bm)
    assert bm.num_free_gpu_blocks() == 64


def test_without_a_window_nothing_is_released():
    bm = BlockManager(4, 64, 8)
    group = make_group("a", 5)
    admit(bm, group)
    for _ in range(30):
        decode(bm, group.seqs[0])
    assert NULL_BLOCK not in bm.get_block_table(group.seqs[0])
    assert bm.num_held_blocks(group.seqs[0]) == 9  # ceil(35 / 4)


def test_exact_table_and_released_blocks_stay_prefix_cached():
    bm = BlockManager(4, 16, 4, sliding_window=8)
    group = make_group("a", list(range(100, 112)))  # 12 tokens: blocks 0, 1, 2
    admit(bm, group)
    seq = group.seqs[0]
    assert bm.get_block_table(seq) == [0, 1, 2]
    decode(bm, seq)  # 13 tokens: position 12 sees 5.. -> block 0 goes
    assert bm.get_block_table(seq) == [NULL_BLOCK, 1, 2, 3]
    assert bm.usage().gpu_cached == 1  # block 0 is a full prompt block: reusable by a prefix hit
    again = make_group("b", list(range(100, 106)))
    admit(bm, again)
    assert bm.get_block_table(again.seqs[0])[0] == 0  # the released block, found by its prefix
    for _ in range(4):
        decode(bm, seq)  # 17 tokens: sees 9.. -> block 1 goes too
    assert bm.get_block_table(seq) == [NULL_BLOCK, NULL_BLOCK, 2, 3, 5]


def test_fork_shares_only_live_blocks_and_swap_round_trip_keeps_the_gaps():
    bm = BlockManager(4, 32, 16, sliding_window=8)
    group = make_group("a", 14)
    admit(bm, group)
    parent = group.seqs[0]
    decode(bm, parent)  # 15 tokens: sees 7.. -> block 0 released
    child = parent.fork(10_000)
    group.seqs.append(child)
    bm.fork(parent, child)
    child.status = SequenceStatus.RUNNING
    check_block_manager(bm)
    assert bm.get_block_table(child) == bm.get_block_table(parent) == [NULL_BLOCK, 1, 2, 3]
    assert bm.num_held_blocks(child) == 3 and bm.usage().gpu_used == 3
    mapping = bm.swap_out(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.SWAPPED
    check_block_manager(bm)
    assert [gpu for gpu, _ in mapping] == [1, 2, 3]  # only the live blocks move
    assert bm.cpu_tables[parent.seq_id][0] == NULL_BLOCK
    copies = bm.swap_in(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
    check_block_manager(bm)
    # the two full prompt blocks are still cached on the GPU: taken back as they are; the
    # partial last block is copied
    assert len(copies) == 1
    assert bm.get_block_table(parent) == bm.get_block_table(child) == [NULL_BLOCK, 1, 2, copies[0][1]]
    decode(bm, parent)
    decode(bm, parent)  # 17 tokens: sees 9.. -> block 1 released from the parent only
    assert bm.num_held_blocks(parent) == 3 and bm.num_held_blocks(child) == 3
    bm.free(parent)
    bm.free(child)
    check_block_manager(bm)
    assert bm.usage().gpu_used == 0


def test_recompute_starts_from_a_whole_table():
    bm = BlockManager(4, 32, 4, sliding_window=8)
    group = make_group("a", 6)
    admit(bm, group)
    seq = group.seqs[0]
    for _ in range(10):
        decode(bm, seq)
    assert bm.get_block_table(seq)[:2] == [NULL_BLOCK, NULL_BLOCK]
    bm.free(seq)
    seq.reset_for_recompute()
    admit(bm, group)  # 16 tokens re-prefilled: all four blocks again
    assert NULL_BLOCK not in bm.get_block_table(seq) and bm.num_held_blocks(seq) == 4
    decode(bm, seq)
    assert bm.get_block_table(seq)[:2] == [NULL_BLOCK, NULL_BLOCK]


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        BlockManager(4, 8, 0, sliding_window=0)
