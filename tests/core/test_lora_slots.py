"""Adapter slots: pins, LRU eviction, FCFS waiting for a slot, deltas to the workers, and
adapter-keyed prefix blocks."""

from __future__ import annotations

import pytest

from rayserve_paged.core.lora import LoRARequest, LoRASlots

from .worlds import finish, make_group, make_world

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def test_slots_fill_free_first_then_evict_the_least_recently_released():
    slots = LoRASlots(2)
    assert [slots.acquire(A), slots.acquire(B), slots.acquire(A)] == [0, 1, 0]
    assert slots.take_updates() == [(0, 1, "/adapters/a"), (1, 2, "/adapters/b")]
    assert not slots.can_acquire(3) and slots.can_acquire(1)
    slots.release(2)  # b idle first
    slots.release(1)
    assert slots.can_acquire(3)  # a still holds one pin: only b may go
    assert slots.acquire(C) == 1
    assert slots.take_updates() == [(1, 3, "/adapters/c")]
    assert slots.slot_of == {1: 0, 3: 1}
    slots.release(1)
    slots.release(3)
    assert slots.acquire(B) == 0  # a was released before c
    assert (slots.counters.num_loads, slots.counters.num_evictions) == (4, 2)
    assert slots.take_updates() == [(0, 2, "/adapters/b")]
    assert slots.take_updates() == []


def _lora_world(max_loras=1, **kwargs):
    s, bm = make_world(**kwargs)
    s.lora_slots = LoRASlots(max_loras)
    return s, bm


def test_a_request_waits_for_a_slot_and_nothing_behind_it_passes():
    s, _ = _lora_world()
    first = make_group("first", 20, 0)
    first.lora_request = A
    second = make_group("second", 20, 1)
    second.lora_request = B
    base = make_group("base", 20, 2)
    for g in (first, second, base):
        s.add_group(g)
    out = s.schedule()
    assert [g.request_id for g, *_ in out.scheduled] == ["first"]
    assert out.message.lora_slot_updates == [(0, 1, "/adapters/a")]
    assert [r.lora_id for r in out.message.new_requests] == [1]
    first.seqs[0].append_token(7)
    out = s.schedule()  # a decode of first; second still waits, and base behind it
    assert [g.request_id for g, *_ in out.scheduled] == ["first"] and out.message.lora_slot_updates == []
    finish(s, first)
    out = s.schedule()
    assert [g.request_id for g, *_ in out.scheduled] == ["second", "base"]
    assert out.message.lora_slot_updates == [(0, 2, "/adapters/b")]
    assert [r.lora_id for r in out.message.new_requests] == [2, 0]
    assert (s.lora_slots.counters.num_loads, s.lora_slots.counters.num_evictions) == (2, 1)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_adapter(mode):
    """A swapped group keeps its pin; a recomputed one gives it back and takes it again."""
    s, _ = _lora_world(max_loras=2, num_gpu=4, preemption_mode=mode)
    old, new = make_group("old", 32, 0), make_group("new", 31, 1)
    old.lora_request, new.lora_request = A, B
    s.add_group(old)
    s.add_group(new)
    s.schedule()
    for g in (old, new):
        g.seqs[0].append_token(7)
    out = s.schedule()  # old needs a third block: new (the newest) is preempted
    assert out.preempted == ["new"]
    assert new.has_lora_slot is (mode == "swap")
    assert s.lora_slots.num_pins == ({1: 1, 2: 1} if mode == "swap" else {1: 1})
    finish(s, old)
    out = s.schedule()
    assert [g.request_id for g, *_ in out.scheduled] == ["new"]
    assert new.has_lora_slot and s.lora_slots.num_pins == {2: 1}
    assert out.message.lora_slot_updates == []  # b never left its slot
    finish(s, new)
    assert s.lora_slots.num_pins == {}


def test_the_same_prompt_on_two_adapters_shares_no_block():
    s, bm = _lora_world(max_loras=2)
    tokens = list(range(40))
    groups = [make_group(name, tokens, i) for i, name in enumerate(["a", "b", "base", "a-again"])]
    groups[0].lora_request, groups[1].lora_request, groups[3].lora_request = A, B, A
    for g in groups:
        s.add_group(g)
    s.schedule()
    tables = [bm.gpu_tables[g.seqs[0].seq_id] for g in groups]
    assert not set(tables[0]) & set(tables[1]) and not set(tables[0]) & set(tables[2])
    assert not set(tables[1]) & set(tables[2])
    assert tables[3][:2] == tables[0][:2]  # the same adapter shares its two full blocks
    assert bm.counters.prefix_cache_hits == 32
