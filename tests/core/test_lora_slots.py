"""Adapter slots: pins, LRU eviction, FCFS waiting for a slot, deltas to the workers, and
adapter-keyed prefix blocks."""

from __future__ import annotations

import pytest

from rayserve_paged.core.lora import LoRARequest, LoRASlots

from .worlds import finish, make_group, make_world

A, B, C = (LoRARequest(name, i, f"/adapters/{name}", f"digest-{name}") for i, name in enumerate("abc", start=1))


def test_slots_fill_free_first_then_evict_the_least_recently_released():
    slots = LoRASlots(2)
    assert [slots.acquire(A), slots.acquire(B), slots.acquire(A)] == [0, 1, 0]
    assert slots.take_updates() == [(0, A.key), (1, B.key)]
    assert not slots.can_acquire(C.key) and slots.can_acquire(A.key)
    slots.release(B.key)  # b idle first
    slots.release(A.key)
    assert slots.can_acquire(C.key)  # a still holds one pin: only b may go
    assert slots.acquire(C) == 1
    assert slots.take_updates() == [(1, C.key)]
    assert slots.slot_of == {A.key: 0, C.key: 1}
    slots.release(A.key)
    slots.release(C.key)
    assert slots.acquire(B) == 0  # a was released before c
    assert (slots.counters.num_loads, slots.counters.num_evictions) == (4, 2)
    assert slots.take_updates() == [(0, B.key)]
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
    assert out.message.lora_slot_updates == [(0, A.key)]
    assert [r.lora_id for r in out.message.new_requests] == [1]
    first.seqs[0].append_token(7)
    out = s.schedule()  # a decode of first; second still waits, and base behind it
    assert [g.request_id for g, *_ in out.scheduled] == ["first"] and out.message.lora_slot_updates == []
    finish(s, first)
    out = s.schedule()
    assert [g.request_id for g, *_ in out.scheduled] == ["second", "base"]
    assert out.message.lora_slot_updates == [(0, B.key)]
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
    assert s.lora_slots.num_pins == ({A.key: 1, B.key: 1} if mode == "swap" else {A.key: 1})
    finish(s, old)
    out = s.schedule()
    assert [g.request_id for g, *_ in out.scheduled] == ["new"]
    assert new.has_lora_slot and s.lora_slots.num_pins == {B.key: 1}
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


def test_a_retired_adapter_frees_its_idle_slot_and_is_forgotten_by_the_workers():
    slots = LoRASlots(2)
    slots.acquire(A)
    slots.acquire(B)
    slots.take_updates()
    with pytest.raises(ValueError, match="still pinned"):
        slots.retire(A.key)
    slots.release(A.key)
    slots.retire(A.key)
    assert slots.slot_of == {B.key: 1} and slots.take_forgets() == [A.key] and slots.take_forgets() == []
    # an adapter with A's id and path but other weights is another adapter: a slot load
    other = LoRARequest("a", 1, "/adapters/a", "digest-other")
    assert slots.acquire(other) == 0 and slots.take_updates() == [(0, other.key)]
