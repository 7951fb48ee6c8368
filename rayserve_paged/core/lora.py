"""LoRA adapters as the scheduler sees them: a request's adapter, and the device slots.

The workers hold `max_loras` adapter slots per LoRA-capable layer (models/lora.py). Which
adapter sits in which slot is decided here, once per step, and sent to the workers as
deltas (`StepMessage.lora_slot_updates`: (slot, adapter key) for each slot that changed);
a row's slot follows from its request's adapter.

An adapter is known everywhere by its content identity, its `LoRAKey` (int id, resolved
path, digest of its weights file): the slots here, the workers' slot pools and CPU memory
(models/lora.py) and, through its id, its prefix-cache chain (block_manager.salt_key). An
id is never reused within a process (the engine binds each id it ever saw to one key), so
two different adapters never share a slot, a CPU entry or a KV block, and a name loaded
again with other weights is a new adapter.

    slot   0        1        2
    holds  A (2)    B (0)    -          A pinned by two admitted groups; B idle (LRU); slot 2 free

A group pins its adapter's slot from admission until it finishes, aborts or is preempted
to recompute (a swapped-out group keeps its pin: it comes back with its KV and its adapter).
A slot whose adapter has no pin is free to take: free slots first, else the least recently
released idle adapter is evicted. A group whose adapter can get no slot waits at the head of
the queue (admission is FCFS): a slot frees when the pinned groups end, and it goes to the
oldest waiter. An adapter that is unregistered and used by no request is retired: its idle
slot is freed and the workers are told to drop its tensors (`StepMessage.lora_forgets`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


LoRAKey = tuple[int, str, str]  # (lora_int_id, resolved lora_path, weights digest): an adapter's identity


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's LoRARequest): its name (what the OpenAI `model`
    field says), a positive integer id unique per adapter, and its PEFT directory. The
    engine registers it with the directory resolved and `digest` set (its weights file's)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    digest: str = ""

    @property
    def key(self) -> LoRAKey:
        return (self.lora_int_id, self.lora_path, self.digest)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name: must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1 (got {self.lora_int_id!r})")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path: must be a non-empty string")


def startup_lora_ids(lora_modules: dict[str, str]) -> dict[str, int]:
    """The int id of each start-up adapter: 1, 2, ... in `lora_modules` order. The engine
    numbers them so, and a fleet's ingress repeats it (the id keys an adapter's prefix chain)."""
    return {name: lora_id for lora_id, name in enumerate(lora_modules, 1)}


class UnknownLoRAError(ValueError):
    """A request names a LoRA adapter the engine does not hold (the server's 404)."""


@dataclass(slots=True)
class LoRASlotCounters:
    num_loads: int = 0  # adapters put into a slot
    num_evictions: int = 0  # ... of which replaced an idle resident adapter


class LoRASlots:
    """Adapter key -> device slot, with pins and an LRU of idle residents (module docstring)."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 (got {max_loras})")
        self.max_loras = max_loras
        self.slot_of: dict[LoRAKey, int] = {}  # resident adapter -> its slot
        self.num_pins: dict[LoRAKey, int] = {}  # resident adapter -> groups pinning it (> 0)
        # resident adapters with no pin, least recently released first: O(1) take and evict
        self._idle: OrderedDict[LoRAKey, None] = OrderedDict()
        self._free = list(range(max_loras - 1, -1, -1))  # pop() gives the lowest slot
        self._updates: list[tuple[int, LoRAKey]] = []  # (slot, adapter) since the last step
        self._forgets: list[LoRAKey] = []  # retired adapters the workers drop, since the last step
        self.counters = LoRASlotCounters()

    def can_acquire(self, key: LoRAKey) -> bool:
        return key in self.slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, lora: LoRARequest) -> int:
        """Pin the adapter's slot (loading it into one first if it is not resident)."""
        key = lora.key
        slot = self.slot_of.get(key)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                victim, _ = self._idle.popitem(last=False)
                slot = self.slot_of.pop(victim)
                self.counters.num_evictions += 1
            self.slot_of[key] = slot
            self._updates.append((slot, key))
            self.counters.num_loads += 1
        self._idle.pop(key, None)
        self.num_pins[key] = self.num_pins.get(key, 0) + 1
        return slot

    def release(self, key: LoRAKey) -> None:
        left = self.num_pins[key] - 1
        if left:
            self.num_pins[key] = left
            return
        del self.num_pins[key]
        self._idle[key] = None  # most recently released: evicted last

    def retire(self, key: LoRAKey) -> None:
        """The adapter is gone for good (unregistered, no request uses it, so no pin): its
        slot, if it holds one, is free again and the workers drop its tensors."""
        if self.num_pins.get(key):
            raise ValueError(f"LoRA adapter {key[0]} is still pinned")
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self._idle.pop(key, None)
            self._free.append(slot)
            self._free.sort(reverse=True)
        self._updates = [u for u in self._updates if u[1] != key]
        self._forgets.append(key)

    def take_updates(self) -> list[tuple[int, LoRAKey]]:
        updates, self._updates = self._updates, []
        return updates

    def take_forgets(self) -> list[LoRAKey]:
        forgets, self._forgets = self._forgets, []
        return forgets

    @property
    def num_pinned(self) -> int:
        return len(self.num_pins)
