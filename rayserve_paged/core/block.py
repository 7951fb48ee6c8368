"""Physical KV blocks and the free-block queue.

The free queue is an intrusive doubly linked list threaded through the blocks themselves, so
a prefix-cache hit can pull a cached block out of the middle of the queue in O(1)
(a `deque.remove` would be O(n) on the hot path of admission).

    head <-> b7 <-> b2 <-> b9 <-> tail        popleft() evicts b7 (least recently freed)
"""

from __future__ import annotations


class PhysicalBlock:
    """One block of `block_size` token slots in a device's KV pool.

    Prefix-cache identity of a full, computed block:
      key       hash((parent key, token ids)): the index into the cache map
      token_ids the block's tokens, compared on every hit (a key collision never matches)
      parent    the block before it in the chain, with that block's `generation` at the
                time, so a hit is only taken after the exact chain before it matched
      parent_key that block's key (or the chain's root key): what a copy of this block in
                another tier is checked against, the block itself being gone by then
    `generation` increases whenever the block's contents are given up (eviction, reuse).
    """

    __slots__ = (
        "block_id",
        "ref_count",
        "key",
        "token_ids",
        "parent",
        "parent_generation",
        "parent_key",
        "generation",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent: PhysicalBlock | None = None
        self.parent_generation = -1
        self.parent_key: int | None = None
        self.generation = 0
        self.prev_free: PhysicalBlock | None = None
        self.next_free: PhysicalBlock | None = None

    @property
    def is_cached(self) -> bool:
        return self.key is not None

    def forget_contents(self) -> None:
        self.key = None
        self.token_ids = None
        self.parent = None
        self.parent_generation = -1
        self.parent_key = None
        self.generation += 1

    def __repr__(self) -> str:
        return f"PhysicalBlock({self.block_id}, ref={self.ref_count}, cached={self.is_cached})"


class FreeBlockQueue:
    """Blocks with reference count 0, least recently freed first."""

    __slots__ = ("_head", "_tail", "num_blocks")

    def __init__(self, blocks: list[PhysicalBlock]) -> None:
        self._head = PhysicalBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = PhysicalBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_blocks

    def append(self, block: PhysicalBlock) -> None:
        """Most recently freed: evicted last."""
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: PhysicalBlock) -> None:
        """Holds nothing worth keeping: handed out first."""
        self._link_after(self._head, block)

    def _link_after(self, prev: PhysicalBlock, block: PhysicalBlock) -> None:
        after = prev.next_free
        prev.next_free = block
        block.prev_free = prev
        block.next_free = after
        after.prev_free = block
        self.num_blocks += 1

    def popleft(self) -> PhysicalBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: PhysicalBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free
