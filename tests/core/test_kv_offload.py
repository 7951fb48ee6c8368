"""Tier 2 of the prefix cache (BlockManager kv_offload): evicted device blocks are copied to
the CPU pool and copied back on a hit, through the step's swap lists.

A fake worker plays every step's message on slot contents (each slot holds a digest of the
token prefix that ends there): swap out, swap in, copy, then the rows write their slots,
then every row checks that every slot before its last query holds its own prefix. A block
restored from the wrong place, read half-overwritten or under another salt fails it."""

from __future__ import annotations

import random

import pytest

from rayserve_paged.core import BlockManager, SequenceStatus
from rayserve_paged.core.lora import LoRARequest
from rayserve_paged.core.scheduler import Scheduler, SchedulerConfig

from .invariants import check_block_manager, check_scheduler
from .worlds import make_group


def make_tiered(num_gpu=6, num_cpu=12, block_size=4, **config) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(block_size, num_gpu, num_cpu, watermark=0.0, kv_offload=True)
    config.setdefault("max_num_batched_tokens", 256)
    config.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**config), bm), bm


class FakeWorker:
    """Slot contents of both pools; applies a message in the workers' order."""

    def __init__(self, bm: BlockManager) -> None:
        self.bs = bm.block_size
        self.gpu = [[None] * self.bs for _ in range(bm.gpu.num_blocks)]
        self.cpu = [[None] * self.bs for _ in range(bm.cpu.num_blocks)]

    def run(self, scheduler: Scheduler, out) -> None:
        msg = out.message
        for src, dst in msg.blocks_to_swap_out:
            self.cpu[dst] = list(self.gpu[src])
        for src, dst in msg.blocks_to_swap_in:
            self.gpu[dst] = list(self.cpu[src])
        for src, dst in msg.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        seqs = {s.seq_id: (s, g.sampling_params.cache_salt) for g in scheduler.groups.values() for s in g.seqs}
        tables = out.block_tables
        rows = list(zip(msg.seq_ids, msg.start_positions, msg.num_query_tokens))
        for seq_id, start, n in rows:  # every row's K/V are written before any attention
            for pos in range(start, start + n):
                self.gpu[tables[seq_id][pos // self.bs]][pos % self.bs] = _digest(*seqs[seq_id], pos)
        for seq_id, start, n in rows:
            for pos in range(start + n):
                held = self.gpu[tables[seq_id][pos // self.bs]][pos % self.bs]
                assert held == _digest(*seqs[seq_id], pos), (seq_id, pos, start)


def _digest(seq, salt: str | None, pos: int):
    return salt, tuple(seq.token_ids[: pos + 1])


def _drive(scheduler: Scheduler, bm: BlockManager, requests, rng: random.Random, max_steps=2000):
    """Admit `requests` (group, output length) a few at a time; run to the end."""
    worker = FakeWorker(bm)
    pending = list(requests)
    lengths = {}
    steps = 0
    while pending or scheduler.has_unfinished_groups():
        for _ in range(rng.randint(0, 2)):
            if pending:
                group, out_len = pending.pop(0)
                lengths[group.request_id] = out_len
                scheduler.add_group(group)
        out = scheduler.schedule()
        worker.run(scheduler, out)
        for group, first_row, num_rows, do_sample, _ in out.scheduled:
            if not do_sample:
                continue
            for seq in group.seqs:
                if seq.status is SequenceStatus.RUNNING:
                    seq.append_token(rng.randint(1, 3))
                    if seq.num_output_tokens >= lengths[group.request_id]:
                        seq.status = SequenceStatus.FINISHED_LENGTH
            scheduler.free_finished(group)
        check_scheduler(scheduler)
        steps += 1
        assert steps < max_steps
    return worker


def _request(rid: str, tokens: list[int], salt: str | None = None):
    return make_group(rid, tokens, cache_salt=salt, max_tokens=64)


def test_an_evicted_prefix_comes_back_from_tier_2_with_exact_copies():
    scheduler, bm = make_tiered(num_gpu=4, num_cpu=8)
    worker = FakeWorker(bm)
    a = list(range(100, 113))  # 13 tokens: 3 full blocks and one more token
    for rid, tokens in (("a", a), ("b", list(range(200, 213))), ("a2", a)):
        group = _request(rid, tokens)
        scheduler.add_group(group)
        out = scheduler.schedule()
        worker.run(scheduler, out)
        msg = out.message
        if rid == "b":  # a's three cached blocks are evicted for b's: copied to tier 2
            assert msg.blocks_to_swap_out == [(2, 0), (1, 1), (0, 2)]  # LRU: a's tail first
            assert msg.blocks_to_swap_in == []
        if rid == "a2":  # its first 12 tokens come back from tier 2; one token is computed
            assert msg.blocks_to_swap_in == [(2, 0), (1, 1), (0, 2)]
            # b's blocks leave for tier 2 before the restores overwrite them, into CPU
            # blocks other than the restores' sources
            assert msg.blocks_to_swap_out == [(1, 3), (2, 4), (3, 5)]
            assert msg.start_positions == [12] and msg.num_query_tokens == [1]
        group.seqs[0].status = SequenceStatus.FINISHED_STOPPED
        scheduler.free_finished(group)
        check_scheduler(scheduler)
    c = bm.counters
    assert (c.offloaded_blocks, c.restored_blocks, c.offload_hits) == (3 + 3, 3, 12)
    assert c.prefix_cache_hits == 0


def test_no_block_is_restored_under_another_salt():
    scheduler, bm = make_tiered(num_gpu=4, num_cpu=8)
    worker = FakeWorker(bm)
    tokens = list(range(100, 113))
    for rid, toks, salt in (("a", tokens, "s1"), ("b", list(range(200, 213)), None), ("c", tokens, "s2"), ("d", tokens, None)):
        group = _request(rid, toks, salt)
        scheduler.add_group(group)
        out = scheduler.schedule()
        worker.run(scheduler, out)
        if rid in ("c", "d"):
            assert out.message.blocks_to_swap_in == [] and out.message.num_query_tokens == [13]
        group.seqs[0].status = SequenceStatus.FINISHED_STOPPED
        scheduler.free_finished(group)
        check_scheduler(scheduler)
    assert bm.counters.restored_blocks == 0


@pytest.mark.parametrize("full_prefill", [{"prompt_logprobs": 1}, {"prompt_logprobs": 0}])
def test_a_request_needing_its_whole_prefill_restores_nothing(full_prefill):
    """Prompt logprobs (and pooled states) come from the request's own prefill: tier 2 is
    skipped like the device cache; its own blocks are cached for the request after it."""
    scheduler, bm = make_tiered(num_gpu=4, num_cpu=8)
    worker = FakeWorker(bm)
    a = list(range(100, 113))
    for rid, tokens, extra in (("a", a, {}), ("b", list(range(200, 213)), {}), ("a2", a, full_prefill), ("a3", a, {})):
        group = make_group(rid, tokens, max_tokens=64, **extra)
        scheduler.add_group(group)
        out = scheduler.schedule()
        worker.run(scheduler, out)
        if rid == "a2":
            assert out.message.blocks_to_swap_in == [] and out.message.num_query_tokens == [13]
        if rid == "a3":
            assert out.message.blocks_to_swap_in == [] and out.message.num_query_tokens == [1]
        group.seqs[0].status = SequenceStatus.FINISHED_STOPPED
        scheduler.free_finished(group)
        check_scheduler(scheduler)


@pytest.mark.parametrize("num_cpu, restored", [(12, 3), (8, 2)])
def test_no_block_is_restored_under_another_adapter_and_tier_2_evicts_lru(num_cpu, restored):
    """12 CPU blocks hold every offloaded block; 8 drop the least recently offloaded first: the
    first adapter's last block (a prefix's tail leaves the device first)."""
    bm = BlockManager(4, 4, num_cpu, watermark=0.0, kv_offload=True)
    tokens = list(range(100, 113))

    def admit_and_free(tokens, lora_id=0):
        group = make_group("r", tokens)
        if lora_id:
            group.lora_request = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}")
        bm.allocate(group)
        seq = group.seqs[0]
        computed = seq.num_computed_tokens
        bm.mark_computed(seq, len(seq))
        offloads, restores = bm.take_tier_copies()
        bm.free(seq)
        check_block_manager(bm)
        return computed, offloads, restores

    assert admit_and_free(tokens, lora_id=1)[0] == 0
    assert len(admit_and_free(list(range(200, 213)))[1]) == 3  # adapter 1's blocks go to tier 2
    for other in (2, 0):  # another adapter, the base model: nothing restored
        computed, _, restores = admit_and_free(tokens, lora_id=other)
        assert (computed, restores) == (0, [])
    computed, _, restores = admit_and_free(tokens, lora_id=1)
    assert computed == 4 * restored and len(restores) == restored
    # four requests' 3 blocks each were offloaded (the last one's as the first came back)
    assert bm.counters.offloaded_blocks == 12
    assert bm.counters.offload_evicted_blocks == max(0, 12 - num_cpu)


def test_randomized_worlds_keep_every_slot_exact_and_compute_less():
    totals = {False: 0, True: 0}  # prompt tokens found cached, both tiers
    restored = 0
    for seed in range(12):
        rng = random.Random(seed)
        prefixes = [[rng.randint(1, 9) for _ in range(rng.choice((8, 12, 16)))] for _ in range(4)]
        salts = [None, None, "s"]

        def world(kv_offload: bool):
            r = random.Random(seed)
            bm = BlockManager(4, 10, 16 if kv_offload else 4, watermark=0.0, kv_offload=kv_offload)
            mode = r.choice(("recompute", "swap", "auto"))
            scheduler = Scheduler(
                SchedulerConfig(max_num_batched_tokens=r.choice((8, 32)), max_model_len=40, max_num_seqs=4, preemption_mode=mode),
                bm,
            )
            requests = []
            for i in range(14):
                tokens = r.choice(prefixes) + [r.randint(1, 9) for _ in range(r.randint(1, 6))]
                group = _request(f"r{i}", tokens, r.choice(salts))
                requests.append((group, r.randint(1, 6)))
            _drive(scheduler, bm, requests, r)
            return bm.counters

        off, on = world(False), world(True)
        assert off.offloaded_blocks == off.restored_blocks == off.offload_hits == 0
        assert on.offload_evicted_blocks <= on.offloaded_blocks
        assert on.restored_blocks * 4 == on.offload_hits
        totals[False] += off.prefix_cache_hits
        totals[True] += on.prefix_cache_hits + on.offload_hits
        restored += on.restored_blocks
    assert restored > 0 and totals[True] > totals[False]
