"""Invariants of the block manager and scheduler, checked after every operation."""

from __future__ import annotations

from collections import Counter

from rayserve_paged.core import BlockManager, Scheduler, SequenceStatus


def check_block_manager(bm: BlockManager) -> None:
    for name, alloc, tables in (("gpu", bm.gpu, bm.gpu_tables), ("cpu", bm.cpu, bm.cpu_tables)):
        in_queue = [b.block_id for b in alloc.free_queue]
        assert len(in_queue) == len(set(in_queue)) == alloc.free_queue.num_blocks, name
        holders = Counter(bid for table in tables.values() for bid in table)
        for block in alloc.blocks:
            # a block is free exactly when nobody holds it
            assert (block.block_id in set(in_queue)) == (block.ref_count == 0), (name, block)
            assert block.ref_count == holders[block.block_id], (name, block, holders[block.block_id])
        for key, block in alloc.cached.items():
            assert block.key == key and block.token_ids is not None, (name, block)
        cached_free = sum(1 for b in alloc.free_queue if b.key is not None and alloc.cached.get(b.key) is b)
        assert cached_free == alloc.num_cached_free, name
    usage = bm.usage()
    assert usage.gpu_used + usage.gpu_cached + usage.gpu_free == usage.gpu_total
    assert usage.cpu_used + usage.cpu_free == usage.cpu_total
    assert min(usage.gpu_used, usage.gpu_cached, usage.gpu_free, usage.cpu_used, usage.cpu_free) >= 0
    assert not set(bm.gpu_tables) & set(bm.cpu_tables), "a sequence lives on one device at a time"


def check_scheduler(s: Scheduler) -> None:
    bm = s.block_manager
    check_block_manager(bm)
    # fcfs: by arrival; priority: by (priority, arrival), waiting included
    key = (lambda g: (g.sampling_params.priority, g.arrival_index)) if s.by_priority else (lambda g: g.arrival_index)
    arrivals = [key(g) for g in s.running]
    assert arrivals == sorted(arrivals), "running is oldest first"
    assert [key(g) for g in s.swapped] == sorted(key(g) for g in s.swapped)
    if s.by_priority:
        assert [key(g) for g in s.waiting] == sorted(key(g) for g in s.waiting)
    queued = list(s.waiting) + s.running + list(s.swapped)
    assert len({id(g) for g in queued}) == len(queued), "a group sits in one queue"
    live = {g.request_id for g in queued if not g.is_finished()}
    assert live <= set(s.groups), "every queued unfinished group is known"
    held = set(bm.gpu_tables) | set(bm.cpu_tables)
    for group in queued:
        for seq in group.seqs:
            st = seq.status
            if st is SequenceStatus.RUNNING:
                assert seq.seq_id in bm.gpu_tables
                assert len(bm.gpu_tables[seq.seq_id]) * bm.block_size >= seq.num_computed_tokens
            elif st is SequenceStatus.SWAPPED:
                assert seq.seq_id in bm.cpu_tables
            else:
                assert seq.seq_id not in held, seq
    known = {seq.seq_id for g in queued for seq in g.seqs}
    assert held <= known, "no blocks held by a sequence the scheduler forgot"
