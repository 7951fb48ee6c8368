"""Exact block ids, free counts, copy lists, swap mappings and eviction order (16-token blocks)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rayserve_paged.core import AllocStatus, BlockManager, SequenceStatus
from rayserve_paged.core.block_manager import prefix_block_keys

from .invariants import check_block_manager
from .worlds import fork_group, make_group


def admit(bm: BlockManager, group):
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
        bm.mark_computed(seq, len(seq))  # the prefill step ran: full blocks become cached
        seq.num_computed_tokens = len(seq)
    check_block_manager(bm)


def decode(bm: BlockManager, seq, token=7):
    """The engine appended a sampled token; reserve its slot as the scheduler would."""
    seq.append_token(token)
    copies = []
    bm.append_slots(seq, copies)
    seq.num_computed_tokens = len(seq)
    check_block_manager(bm)
    return copies


def test_allocate_takes_blocks_in_order_and_wastes_under_one_block():
    bm = BlockManager(16, 12, 4)
    group = make_group("a", 40)
    admit(bm, group)
    assert bm.get_block_table(group.seqs[0]) == [0, 1, 2]
    usage = bm.usage()
    assert (usage.gpu_used, usage.gpu_free, usage.gpu_cached) == (3, 9, 0)


def test_append_takes_a_new_block_only_when_the_last_is_full():
    bm = BlockManager(16, 12, 4)
    group = make_group("a", 47)
    admit(bm, group)
    seq = group.seqs[0]
    assert decode(bm, seq) == []  # token 48 fills block 2
    assert bm.get_block_table(seq) == [0, 1, 2]
    assert decode(bm, seq) == []  # token 49 needs block 3
    assert bm.get_block_table(seq) == [0, 1, 2, 3]
    assert bm.usage().gpu_used == 4


def forked_pair(num_cpu: int):
    """A 40-token request admitted to a pool of 12 GPU blocks (no prefix cache), forked
    once: (bm, group, parent, child), the two sharing blocks 0, 1, 2."""
    bm = BlockManager(16, 12, num_cpu, enable_prefix_caching=False)
    group = make_group("a", 40)
    admit(bm, group)
    (child,) = fork_group_direct(bm, group, 1)
    return bm, group, group.seqs[0], child


def test_fork_shares_blocks_and_copy_on_write_copies_only_the_last():
    bm, group, parent, child = forked_pair(num_cpu=4)
    assert [bm.gpu.blocks[b].ref_count for b in (0, 1, 2)] == [2, 2, 2]
    assert bm.usage().gpu_used == 3
    # the parent writes token 41 into shared block 2: copy it to block 3 first
    assert decode(bm, parent) == [(2, 3)]
    assert bm.get_block_table(parent) == [0, 1, 3]
    # the child is now the only holder of block 2: no copy
    assert decode(bm, child) == []
    assert bm.get_block_table(child) == [0, 1, 2]
    assert [bm.gpu.blocks[b].ref_count for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert bm.counters.copy_on_write_blocks == 1


def fork_group_direct(bm, group, n):
    from .worlds import _seq_ids

    parent = group.seqs[0]
    children = []
    for _ in range(n):
        child = parent.fork(next(_seq_ids))
        bm.fork(parent, child)
        group.seqs.append(child)
        children.append(child)
    return children


def test_free_returns_every_block_and_keeps_full_prefix_blocks_cached():
    bm = BlockManager(16, 12, 4)
    group = make_group("a", 40)
    admit(bm, group)
    bm.free(group.seqs[0])
    usage = bm.usage()
    # blocks 0 and 1 are full: kept for prefix reuse; block 2 (8 tokens) is simply free
    assert (usage.gpu_used, usage.gpu_cached, usage.gpu_free) == (0, 2, 10)
    assert [b.block_id for b in bm.gpu.free_queue][:1] == [2]  # empty blocks are handed out first
    check_block_manager(bm)


def test_prefix_hit_reuses_the_longest_cached_chain_and_pulls_it_from_the_free_queue():
    bm = BlockManager(16, 12, 4)
    a = make_group("a", list(range(100, 140)))  # 40 tokens: blocks 0, 1 full
    admit(bm, a)
    bm.free(a.seqs[0])
    b = make_group("b", list(range(100, 132)) + [5, 6, 7])  # same 32-token prefix
    admit(bm, b)
    assert bm.get_block_table(b.seqs[0])[:2] == [0, 1]
    assert b.seqs[0].num_computed_tokens == 35  # (set by admit); the hit was 32 tokens:
    assert bm.counters.prefix_cache_hits == 32
    assert bm.counters.prefix_cache_queries == 40 + 35
    assert bm.usage().gpu_cached == 0


def test_hit_sets_computed_tokens_and_the_last_token_is_always_computed():
    bm = BlockManager(16, 12, 4)
    prompt = list(range(500, 532))  # exactly two full blocks
    a = make_group("a", prompt)
    admit(bm, a)
    b = make_group("b", prompt)  # identical prompt
    bm.allocate(b)
    seq = b.seqs[0]
    # only tokens[:-1] are looked up: block 0 is a hit, block 1 is computed again
    assert seq.num_computed_tokens == 16
    assert bm.get_block_table(seq) == [0, 2]
    c = make_group("c", prompt + [1])  # one more token: both full blocks hit
    bm.allocate(c)
    assert c.seqs[0].num_computed_tokens == 32
    assert bm.get_block_table(c.seqs[0]) == [0, 1, 3]


def test_cached_blocks_are_evicted_least_recently_freed_first_and_tails_before_heads():
    bm = BlockManager(16, 6, 0)
    a = make_group("a", list(range(1000, 1033)))  # blocks 0,1 full, 2 partial
    b = make_group("b", list(range(2000, 2033)))  # blocks 3,4 full, 5 partial
    admit(bm, a)
    admit(bm, b)
    bm.free(a.seqs[0])
    bm.free(b.seqs[0])
    # queue: empty blocks first (5, 2), then cached in LRU order, each chain tail first
    assert [blk.block_id for blk in bm.gpu.free_queue] == [5, 2, 1, 0, 4, 3]
    c = make_group("c", list(range(3000, 3050)))  # 4 blocks, no hit: evicts 1 then 0
    admit(bm, c)
    assert bm.get_block_table(c.seqs[0]) == [5, 2, 1, 0]
    assert bm.usage().gpu_cached == 2
    bm.free(c.seqs[0])
    d = make_group("d", list(range(2000, 2033)))  # b's prefix survived
    bm.allocate(d)
    assert bm.get_block_table(d.seqs[0])[:2] == [3, 4]
    check_block_manager(bm)


def test_a_hash_collision_never_returns_a_block_with_other_tokens():
    bm = BlockManager(16, 12, 4, hash_fn=lambda parent, tokens: 0)  # every key collides
    a = make_group("a", list(range(100, 140)))
    admit(bm, a)
    b = make_group("b", list(range(200, 240)))
    bm.allocate(b)
    assert b.seqs[0].num_computed_tokens == 0
    assert set(bm.get_block_table(b.seqs[0])).isdisjoint(bm.get_block_table(a.seqs[0]))
    c = make_group("c", list(range(100, 116)) + list(range(300, 320)))
    bm.allocate(c)  # first block equal (a hit), second differs behind the same key
    assert c.seqs[0].num_computed_tokens == 16
    check_block_manager(bm)


def test_cache_salt_keys_the_first_block_so_only_the_same_salt_hits():
    bm = BlockManager(16, 12, 4)
    prompt = list(range(100, 140))  # 40 tokens: blocks full at 0, 1
    a = make_group("a", prompt, cache_salt="tenant-a")
    admit(bm, a)
    assert bm.get_block_table(a.seqs[0]) == [0, 1, 2]
    bm.free(a.seqs[0])
    # unsalted, and another salt: the same tokens find nothing
    for request_id, salt in (("none", None), ("b", "tenant-b")):
        group = make_group(request_id, prompt, cache_salt=salt)
        bm.allocate(group)
        assert group.seqs[0].num_computed_tokens == 0, request_id
        assert not set(bm.get_block_table(group.seqs[0])) & {0, 1}, request_id
        bm.free(group.seqs[0])
    assert bm.counters.prefix_cache_hits == 0
    # the same salt: the whole chain, the same block ids
    again = make_group("a2", prompt, cache_salt="tenant-a")
    bm.allocate(again)
    assert again.seqs[0].num_computed_tokens == 32
    assert bm.get_block_table(again.seqs[0])[:2] == [0, 1]
    assert bm.counters.prefix_cache_hits == 32
    check_block_manager(bm)


def test_an_unsalted_chain_is_not_found_by_a_salted_request_and_salts_follow_forks():
    bm = BlockManager(16, 12, 4)
    plain = make_group("plain", list(range(700, 720)))  # block 0 full, 4 tokens in block 1
    admit(bm, plain)
    salted = make_group("salted", list(range(700, 720)), cache_salt="s")
    bm.allocate(salted)
    assert salted.seqs[0].num_computed_tokens == 0 and bm.get_block_table(salted.seqs[0]) == [2, 3]
    bm.free(salted.seqs[0])
    # a fork registers its own first block under its group's salt
    short = make_group("short", [700, 701, 702, 703], cache_salt="s")
    admit(bm, short)
    (child,) = fork_group_direct(bm, short, 1)
    for i in range(12):  # the child's copy of block 0 fills: it gets a (salted) identity
        decode(bm, child, token=704 + i)
    child_block = bm.get_block_table(child)[0]
    assert child.token_ids == list(range(700, 716)) and bm.gpu.blocks[child_block].is_cached
    bm.free(short.seqs[0])
    bm.free(child)
    prompt = list(range(700, 716)) + [9]
    same_salt = make_group("same", prompt, cache_salt="s")
    bm.allocate(same_salt)
    assert same_salt.seqs[0].num_computed_tokens == 16
    assert bm.get_block_table(same_salt.seqs[0])[0] == child_block
    unsalted = make_group("unsalted", prompt)
    bm.allocate(unsalted)
    assert unsalted.seqs[0].num_computed_tokens == 16
    assert bm.get_block_table(unsalted.seqs[0])[0] == 0  # plain's block, not the salted one
    assert child_block != 0
    check_block_manager(bm)


def test_swap_in_takes_back_resident_blocks_of_its_own_salt_only():
    """A salted request swapped out and back in re-shares a GPU copy of its prefix only
    when that copy is of its own salt: an unsalted request's cached block with the same
    tokens is not taken (a hit there would cross the salt, as admission never does)."""
    bm = BlockManager(16, 12, 8)
    prompt = list(range(500, 536))  # blocks full at 0, 1
    plain = make_group("plain", prompt)
    admit(bm, plain)
    salted = make_group("salted", prompt, cache_salt="s")
    admit(bm, salted)
    (seq,) = salted.seqs
    salted_blocks = bm.get_block_table(seq)
    assert not set(salted_blocks) & set(bm.get_block_table(plain.seqs[0]))
    bm.swap_out(salted)
    seq.status = SequenceStatus.SWAPPED
    back = dict(bm.swap_in(salted))
    seq.status = SequenceStatus.RUNNING
    # its own two full blocks are still cached on the GPU (salted): taken back, not copied;
    # the partial third is copied; none of plain's same-token blocks is taken
    assert len(back) == 1 and bm.get_block_table(seq)[:2] == salted_blocks[:2]
    assert not set(bm.get_block_table(seq)) & set(bm.get_block_table(plain.seqs[0]))
    check_block_manager(bm)


def test_cache_salt_must_be_a_non_empty_string():
    from rayserve_paged.core import SamplingParams, SamplingParamsError

    for bad in ("", 5, b"x"):
        with pytest.raises(SamplingParamsError, match="cache_salt: must be a non-empty string"):
            SamplingParams(cache_salt=bad)
    assert SamplingParams(cache_salt="t").cache_salt == "t" and SamplingParams().cache_salt is None


def test_can_allocate_says_never_for_a_prompt_that_cannot_fit_and_later_when_busy():
    bm = BlockManager(16, 12, 4)
    assert bm.can_allocate(make_group("x", 12 * 16 + 1)) is AllocStatus.NEVER
    assert bm.can_allocate(make_group("y", 12 * 16)) is AllocStatus.OK
    admit(bm, make_group("a", 100))  # 7 blocks
    assert bm.can_allocate(make_group("z", 5 * 16)) is AllocStatus.OK
    assert bm.can_allocate(make_group("w", 5 * 16 + 1)) is AllocStatus.LATER


def test_watermark_holds_back_admissions_but_never_refuses_what_the_pool_holds():
    bm = BlockManager(16, 12, 4, watermark=0.25)  # 3 blocks held back
    assert bm.watermark_blocks == 3
    # the watermark guards against thrashing between groups: a group that will run alone
    # may take the whole pool, so only more than the pool is NEVER
    assert bm.can_allocate(make_group("x", 10 * 16)) is AllocStatus.LATER
    assert bm.can_allocate(make_group("x", 12 * 16), use_watermark=False) is AllocStatus.OK
    assert bm.can_allocate(make_group("x", 12 * 16 + 1), use_watermark=False) is AllocStatus.NEVER
    assert bm.can_allocate(make_group("y", 9 * 16)) is AllocStatus.OK
    admit(bm, make_group("a", 16))
    assert bm.can_allocate(make_group("z", 9 * 16)) is AllocStatus.LATER


def test_swap_out_and_in_map_each_shared_block_once():
    bm, group, parent, child = forked_pair(num_cpu=8)
    decode(bm, parent)  # parent: [0, 1, 3], child: [0, 1, 2]
    assert bm.can_swap_out(group)
    mapping = bm.swap_out(group)
    assert mapping == [(0, 0), (1, 1), (3, 2), (2, 3)]
    for seq in group.seqs:
        seq.status = SequenceStatus.SWAPPED
    assert bm.cpu_tables[parent.seq_id] == [0, 1, 2]
    assert bm.cpu_tables[child.seq_id] == [0, 1, 3]
    assert bm.usage().gpu_used == 0 and bm.usage().cpu_used == 4
    check_block_manager(bm)
    assert bm.can_swap_in(group)
    back = bm.swap_in(group)
    # freed GPU blocks come back most recently freed last: 2, 3, 1, 0 were freed in that order
    assert sorted(cpu for cpu, _ in back) == [0, 1, 2, 3]
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
    gpu_of = dict(back)
    assert bm.get_block_table(parent) == [gpu_of[0], gpu_of[1], gpu_of[2]]
    assert bm.get_block_table(child) == [gpu_of[0], gpu_of[1], gpu_of[3]]
    assert bm.counters.swapped_out_blocks == 4 and bm.counters.swapped_in_blocks == 4
    check_block_manager(bm)


def test_swap_out_is_refused_when_the_cpu_pool_is_too_small():
    bm = BlockManager(16, 12, 2)
    group = make_group("a", 40)
    admit(bm, group)
    assert not bm.can_swap_out(group)


def test_reset_prefix_cache_forgets_every_identity():
    bm = BlockManager(16, 12, 4)
    a = make_group("a", 40)
    admit(bm, a)
    b = make_group("b", 40)
    admit(bm, b)
    bm.free(a.seqs[0])
    bm.reset_prefix_cache()
    assert bm.gpu.cached == {} and bm.usage().gpu_cached == 0
    check_block_manager(bm)
    c = make_group("c", 40)
    bm.allocate(c)
    assert c.seqs[0].num_computed_tokens == 0


@pytest.mark.parametrize("bad", [dict(block_size=0), dict(num_gpu_blocks=0), dict(watermark=1.5)])
def test_bad_configuration_is_refused_with_the_field_named(bad):
    args = dict(block_size=16, num_gpu_blocks=4, num_cpu_blocks=0) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        BlockManager(**args)


def test_slot_usage_counts_token_slots_and_shared_blocks_per_pool():
    """The paper's Figure 2 quantity on a hand-computed state (16-token blocks):

        a  20 tokens  [0: 16][1: 4 ]                 a forked into b, then b decodes once:
        b  21 tokens  [0: 16][2: 5 ]                 block 1 is copied to 2 (copy-on-write)
        c  33 tokens  [3: 16][4: 16][5: 1]
    GPU: used 16 + 4 + 5 + 16 + 16 + 1 = 58 of 6 x 16 = 96 slots; block 0 is shared.
    Then c swaps out: its 33 tokens in 3 CPU blocks, and the GPU keeps 25 of 48."""
    bm = BlockManager(16, 12, 4, enable_prefix_caching=False)
    a_group, c_group = make_group("a", 20), make_group("c", 33)
    admit(bm, a_group)
    (b,) = fork_group_direct(bm, a_group, 1)
    assert decode(bm, b) == [(1, 2)]
    admit(bm, c_group)
    a, c = a_group.seqs[0], c_group.seqs[0]
    assert (bm.get_block_table(a), bm.get_block_table(b), bm.get_block_table(c)) == ([0, 1], [0, 2], [3, 4, 5])
    gpu, cpu = bm.slot_usage([a, b, c])
    assert (gpu.used_slots, gpu.allocated_slots, gpu.num_allocated_blocks, gpu.num_shared_blocks) == (58, 96, 6, 1)
    assert gpu.fragmentation == pytest.approx(1 - 58 / 96)
    assert (cpu.used_slots, cpu.allocated_slots, cpu.num_shared_blocks, cpu.fragmentation) == (0, 0, 0, 0.0)

    assert bm.swap_out(c_group) == [(3, 0), (4, 1), (5, 2)]
    gpu, cpu = bm.slot_usage([a, b, c])
    assert (gpu.used_slots, gpu.allocated_slots, gpu.num_shared_blocks) == (25, 48, 1)
    assert (cpu.used_slots, cpu.allocated_slots, cpu.num_allocated_blocks, cpu.num_shared_blocks) == (33, 48, 3, 0)

    # a sequence holding no blocks (finished, freed) counts for nothing; usage() agrees on blocks
    bm.free(b)
    gpu, _ = bm.slot_usage([a, b, c])
    assert (gpu.used_slots, gpu.allocated_slots, gpu.num_shared_blocks) == (20, 32, 0)
    assert gpu.num_allocated_blocks == bm.usage().gpu_used == 2


def test_prefix_block_keys_name_the_chains_the_cache_holds_in_any_process():
    bm = BlockManager(16, 12, 4)
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks, tokens[:-1] look up 3
    salted = list(range(500, 533))  # 33 tokens: 2 full blocks
    admit(bm, make_group("a", prompt))
    admit(bm, make_group("b", salted, cache_salt="tenant-a"))
    keys = prefix_block_keys(prompt, 16)
    salted_keys = prefix_block_keys(salted, 16, "tenant-a")
    assert len(keys) == 3 and len(salted_keys) == 2
    assert sorted(bm.cached_prefix_keys()) == sorted(keys + salted_keys)
    # a prompt of exactly 2 blocks looks up only the first (its last token is computed)
    assert prefix_block_keys(prompt[:32], 16) == keys[:1]
    assert prefix_block_keys(salted, 16, "tenant-b")[0] not in salted_keys
    # another interpreter (another hash seed) computes the same keys
    code = (
        "from rayserve_paged.core.block_manager import prefix_block_keys as k;"
        f"print(k({prompt!r}, 16), k({salted!r}, 16, 'tenant-a'))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == f"{keys} {salted_keys}"
