"""LoRA adapters as the scheduler sees them: a request's adapter, and the device slots.

The workers hold `max_loras` adapter slots per LoRA-capable layer (models/lora.py). Which
adapter sits in which slot is decided here, once per step, and sent to the workers as
deltas (`StepMessage.lora_slot_updates`: (slot, adapter id, path) for each slot that changed);
a row's slot follows from its request's adapter.

    slot   0        1        2
    holds  A (2)    B (0)    -          A pinned by two admitted groups; B idle (LRU); slot 2 free

A group pins its adapter's slot from admission until it finishes, aborts or is preempted
to recompute (a swapped-out group keeps its pin: it comes back with its KV and its adapter).
A slot whose adapter has no pin is free to take: free slots first, else the least recently
released idle adapter is evicted. A group whose adapter can get no slot waits at the head of
the queue (admission is FCFS): a slot frees when the pinned groups end, and it goes to the
oldest waiter.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's LoRARequest): its name (what the OpenAI `model`
    field says), a positive integer id unique per adapter, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

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
    """Adapter id -> device slot, with pins and an LRU of idle residents (module docstring)."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 (got {max_loras})")
        self.max_loras = max_loras
        self.slot_of: dict[int, int] = {}  # resident adapter id -> its slot
        self.num_pins: dict[int, int] = {}  # resident adapter id -> groups pinning it (> 0)
        # resident adapters with no pin, least recently released first: O(1) take and evict
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._free = list(range(max_loras - 1, -1, -1))  # pop() gives the lowest slot
        self._updates: list[tuple[int, int, str]] = []  # (slot, adapter id, path) since the last step
        self.counters = LoRASlotCounters()

    def can_acquire(self, lora_id: int) -> bool:
        return lora_id in self.slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, lora: LoRARequest) -> int:
        """Pin the adapter's slot (loading it into one first if it is not resident)."""
        lora_id = lora.lora_int_id
        slot = self.slot_of.get(lora_id)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                victim, _ = self._idle.popitem(last=False)
                slot = self.slot_of.pop(victim)
                self.counters.num_evictions += 1
            self.slot_of[lora_id] = slot
            self._updates.append((slot, lora_id, lora.lora_path))
            self.counters.num_loads += 1
        self._idle.pop(lora_id, None)
        self.num_pins[lora_id] = self.num_pins.get(lora_id, 0) + 1
        return slot

    def release(self, lora_id: int) -> None:
        left = self.num_pins[lora_id] - 1
        if left:
            self.num_pins[lora_id] = left
            return
        del self.num_pins[lora_id]
        self._idle[lora_id] = None  # most recently released: evicted last

    def take_updates(self) -> list[tuple[int, int, str]]:
        updates, self._updates = self._updates, []
        return updates

    @property
    def num_pinned(self) -> int:
        return len(self.num_pins)
