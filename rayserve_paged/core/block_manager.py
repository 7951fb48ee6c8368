"""The paged KV block manager: block tables, reference counts, copy-on-write, swapping and
automatic prefix caching, for one GPU pool and one CPU swap pool.

A sequence's logical blocks fill left to right; a physical block is taken only when the
last one is full, so each sequence wastes less than one block:

    tokens    [t0 .. t15][t16 .. t31][t32 t33 .  .  ]      block_size 16
    table     [    7    ][    2    ][    9         ]      physical ids on the GPU pool

Invariants (checked by tests after every operation):
  - a block is in the free queue  <=>  its reference count is 0;
  - a block's reference count == the number of block tables that hold it;
  - used + cached + free == total on each device (cached: ref 0 but still holding a
    reusable full block of a prefix; free: ref 0 and empty);
  - block tables change only by appending, by replacing the last entry (copy-on-write), or
    (with a sliding window) by turning a leading entry into NULL_BLOCK.

Sliding window (every layer of the model windowed, `sliding_window=W`): when a decode step
makes room for position n - 1, the blocks wholly before that query's window (positions
< n - W) go back to the pool and their table entries become NULL_BLOCK, so a sequence holds
at most ceil(W / block_size) + 1 blocks however long it runs:

    positions [0 .. 3][4 .. 7][8 .. 11][12 13 .  .]    W = 8, n = 14, block_size 4
    table     [ NULL ][ NULL ][   5   ][    2     ]    keys 6.. are visible: block 1 goes too

Workers keep the ids they were sent (the kernels never read a block before the window); a
released block keeps its prefix-cache identity in the free queue like any freed block.
Prefill chunks release nothing (the first decode does); a sequence's blocks after a NULL
entry get no prefix-cache identity (their chain has a gap). Swapping moves the live blocks
only; recompute starts from a whole table again.

A request's `cache_salt` keys its first block's hash (the parent key of block 0 is derived
from the salt instead of "no parent"), so its whole chain is found only by requests with
the same salt: prefix reuse, and the timing and `cached_tokens` it shows, stay within them.
A request's LoRA adapter keys it the same way (with the salt, when both are set).

Prefix-cache registration happens when a full block is scheduled to be computed, so a
request admitted later in the same step may already share it. The model runner guarantees
this is safe: in every layer the whole step's new K/V are written into the cache before any
attention of that step reads it.

Tier 2 (`kv_offload`): the CPU swap pool doubles as a second prefix cache. Its ref-0 blocks
that hold a copy of an evicted device block stay in its free queue, LRU, keyed like the
device cache; a swap-out takes any free CPU block, a tier-2 copy included (swap takes
precedence). Per step (take_tier_copies, at the end of Scheduler.schedule):

    device block d evicted (its prefix cached, computed before this step)
        -> (d, c) joins blocks_to_swap_out          c: a CPU block, tier 2 evicts LRU
    admission: device hits, then the chain goes on in tier 2 at c
        -> new device block d', (c, d') joins blocks_to_swap_in, d' counts as computed

Workers copy swap-outs, then swap-ins, then copy-on-write, then run the rows, so an evicted
block is read before its new owner (a restore, a copy or a row) writes it, and a restored
block is whole before any attention reads it. A CPU block a copy of this step reads (a
restore's or a swap-in's source) is held until the step's offloads have their places, so
no offload overwrites it. A block registered in this step (its K/V not computed yet) is
not offloaded. A tier-2 entry is checked against the key of the block before it and its
token ids; after the first tier-2 hit the chain goes on in tier 2 only. Groups of several
waiting sequences (a recomputed fork) take device hits only.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rayserve_paged.core.block import FreeBlockQueue, PhysicalBlock
from rayserve_paged.core.sequence import Sequence, SequenceGroup, SequenceStatus

HashFn = Callable[[int | None, tuple[int, ...]], int]
BlockMapping = list[tuple[int, int]]

NULL_BLOCK = -1  # a table entry whose block was released (wholly before the sliding window)


def default_block_hash(parent_key: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((-1 if parent_key is None else parent_key, token_ids))


def salt_key(cache_salt: str | None, lora_id: int = 0) -> int | None:
    """The parent key of a salted chain's first block (None: unsalted, base model). A hit
    also needs the block's parent to be the very block before it, so a salted first block is
    never taken as a later block of another chain, nor the other way round. A request's
    LoRA adapter salts its chain the same way: the same prompt on two adapters (or on an
    adapter and the base model) shares no block, since its K/V differ.

    The same in every process (a digest, not `hash()` of a string, which each process
    seeds differently): a fleet's router computes the keys its replicas hold."""
    if cache_salt is None and not lora_id:
        return None
    if lora_id:
        digest = hashlib.blake2b(digest_size=8, person=b"lora")
        digest.update(lora_id.to_bytes(8, "little", signed=True))
        digest.update(b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8", "surrogatepass"))
    else:
        digest = hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=8, person=b"cache_salt")
    return int.from_bytes(digest.digest(), "little", signed=True)


def _no_match(token_ids: list[int], root_key: int | None = None) -> list:
    return []


def prefix_block_keys(
    token_ids: list[int],
    block_size: int,
    cache_salt: str | None = None,
    hash_fn: HashFn = default_block_hash,
    lora_id: int = 0,
) -> list[int]:
    """The prefix-cache keys of the full blocks a request's prompt would look up at
    admission (as `BlockManager._match_prefix` walks them: tokens[:-1]), first block first.
    Equal in every process for the same tokens, salt and adapter (token tuples hash alike
    everywhere), so a key names one cached chain on whichever replica holds it."""
    keys: list[int] = []
    parent_key = salt_key(cache_salt, lora_id)
    for i in range((len(token_ids) - 1) // block_size):
        parent_key = hash_fn(parent_key, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        keys.append(parent_key)
    return keys


def group_root_key(group: SequenceGroup) -> int | None:
    """The parent key of the group's first block: its cache salt and its adapter."""
    return salt_key(group.sampling_params.cache_salt, group.lora_id)


class AllocStatus(enum.Enum):
    OK = "ok"  # fits now
    LATER = "later"  # fits once other requests release blocks
    NEVER = "never"  # can never fit in this pool


@dataclass(slots=True)
class BlockUsage:
    block_size: int
    gpu_total: int
    gpu_used: int
    gpu_cached: int
    gpu_free: int
    cpu_total: int
    cpu_used: int
    cpu_free: int

    @property
    def gpu_usage(self) -> float:
        return self.gpu_used / self.gpu_total if self.gpu_total else 0.0

    @property
    def cpu_usage(self) -> float:
        return self.cpu_used / self.cpu_total if self.cpu_total else 0.0


@dataclass(slots=True)
class SlotUsage:
    """Token slots of one pool: what sequences hold against what their blocks offer.

    The paper's Figure 2 quantity, live: `used_slots / allocated_slots` is the share of the
    allocated KV memory that holds token state; the rest is internal fragmentation (the
    unfilled tail of each sequence's last block). A block shared by several sequences
    (fork, beam search, a prefix-cache hit) is counted once, filled as far as its fullest
    holder fills it.

        seq a  [t0 .. t15][t16 .. t19 .  .  ]        blocks 0, 1    used 20 of 32 slots
        seq b  [t0 .. t15][t16 t17 .  .  .  ]        blocks 0, 2    block 0 shared
        pool: used 16 + 4 + 2 = 22, allocated 3 x 16 = 48, shared blocks 1
    """

    used_slots: int = 0
    allocated_slots: int = 0
    num_allocated_blocks: int = 0
    num_shared_blocks: int = 0  # held by more than one sequence

    @property
    def fragmentation(self) -> float:
        """Share of allocated slots holding no token (0 when nothing is allocated)."""
        if not self.allocated_slots:
            return 0.0
        return 1.0 - self.used_slots / self.allocated_slots


@dataclass(slots=True)
class BlockCounters:
    """Monotonic counters exported as telemetry."""

    copy_on_write_blocks: int = 0
    swapped_in_blocks: int = 0
    swapped_out_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up (prompt tokens at admission)
    prefix_cache_hits: int = 0  # of those, tokens found in cached blocks
    # the second tier (kv offload, see BlockManager): blocks and tokens per tier
    prefix_cache_evicted_blocks: int = 0  # device blocks whose cached prefix was given up
    offload_hits: int = 0  # tokens found in tier 2 (restored, not recomputed)
    offloaded_blocks: int = 0  # device -> tier 2 copies
    restored_blocks: int = 0  # tier 2 -> device copies
    offload_evicted_blocks: int = 0  # tier-2 entries dropped (LRU, or taken by a swap-out)


class DeviceAllocator:
    """Reference-counted blocks of one device pool, with an optional prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [PhysicalBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, PhysicalBlock] = {}  # key -> block holding that prefix block
        self.num_cached_free = 0  # ref 0 blocks still reachable through `cached`
        self.on_evict: Callable[[PhysicalBlock], None] | None = None  # before a cached block is given up

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty ones plus evictable cached ones)."""
        return self.free_queue.num_blocks

    def allocate(self) -> PhysicalBlock:
        block = self.free_queue.popleft()
        if block.key is not None:
            if self.on_evict is not None:
                self.on_evict(block)
            self._evict(block)
        block.ref_count = 1
        return block

    def hold(self, block: PhysicalBlock) -> None:
        """Take a reference on any block, cached or empty, in the free queue or not."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
            if block.key is not None and self.cached.get(block.key) is block:
                self.num_cached_free -= 1
        block.ref_count += 1

    def reuse(self, block: PhysicalBlock) -> None:
        """Take a reference on a block found in the prefix cache."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
            self.num_cached_free -= 1
        block.ref_count += 1

    def incref(self, block: PhysicalBlock) -> None:
        block.ref_count += 1

    def decref(self, block: PhysicalBlock) -> None:
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.key is not None and self.cached.get(block.key) is block:
            self.free_queue.append(block)  # keep it: most recently used, evicted last
            self.num_cached_free += 1
        else:
            block.forget_contents()
            self.free_queue.appendleft(block)  # nothing worth keeping: handed out first

    def register(self, block: PhysicalBlock, parent: PhysicalBlock | None, key: int, tokens, parent_key=None) -> None:
        block.key = key
        block.token_ids = tokens
        block.parent = parent
        block.parent_generation = -1 if parent is None else parent.generation
        block.parent_key = parent_key
        self.cached.setdefault(key, block)  # a duplicate of a cached block stays unlisted

    def _evict(self, block: PhysicalBlock) -> None:
        if self.cached.get(block.key) is block:
            del self.cached[block.key]
            self.num_cached_free -= 1
        block.forget_contents()

    def reset_cache(self) -> None:
        for block in list(self.cached.values()):
            if block.ref_count == 0:
                self.free_queue.remove(block)
                self._evict(block)
                self.free_queue.appendleft(block)
            else:
                del self.cached[block.key]
                block.forget_contents()


class BlockManager:
    """Owns every block table; only it decides where K/V live.

    Workers receive block ids and the step's (src, dst) lists and never allocate.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = default_block_hash,
        sliding_window: int | None = None,
        kv_offload: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1 (got {num_gpu_blocks})")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0 (got {num_cpu_blocks})")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1) (got {watermark})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (got {sliding_window})")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.hash_fn = hash_fn
        self.gpu = DeviceAllocator(num_gpu_blocks, enable_prefix_caching)
        # tier 2 (see the module docstring): the CPU pool's free blocks also cache prefixes
        self.kv_offload = kv_offload and enable_prefix_caching and num_cpu_blocks > 0
        self.cpu = DeviceAllocator(num_cpu_blocks, enable_caching=self.kv_offload)
        self._fresh: set[int] | None = None  # device blocks registered this step (tier 2 on)
        # device blocks evicted this step, to offload: (gpu id, key, parent key, token ids)
        self._evicted: list[tuple[int, int, int | None, tuple[int, ...]]] = []
        self._restores: BlockMapping = []  # (cpu id, gpu id) restores of this step
        self._swapped_in: list[int] = []  # CPU blocks this step's swap-ins read
        self._held: list[PhysicalBlock] = []  # CPU blocks held to the step's end (read by a copy)
        self.gpu.on_evict = self._note_device_eviction
        if self.kv_offload:
            self._fresh = set()
            self.cpu.on_evict = self._note_tier_eviction
        self.gpu_tables: dict[int, list[int]] = {}
        self.cpu_tables: dict[int, list[int]] = {}
        # Leading blocks of each sequence already given a prefix-cache identity.
        self._num_registered: dict[int, int] = {}
        # The first block's parent key of each salted sequence (salt_key); absent: unsalted.
        self._salt_keys: dict[int, int] = {}
        # Leading entries of each sequence's table released to the pool (NULL_BLOCK).
        self._num_released: dict[int, int] = {}
        self.counters = BlockCounters()

    # ------------------------------------------------------------------ queries

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.gpu_tables[seq.seq_id]

    def has_gpu_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self.gpu_tables

    def has_blocks(self, seq: Sequence) -> bool:
        """Whether the sequence holds blocks on either device."""
        return seq.seq_id in self.gpu_tables or seq.seq_id in self.cpu_tables

    def num_free_gpu_blocks(self) -> int:
        return self.gpu.num_free_blocks

    def usage(self) -> BlockUsage:
        gpu_free_all = self.gpu.num_free_blocks
        cpu_free = self.cpu.num_free_blocks
        return BlockUsage(
            block_size=self.block_size,
            gpu_total=self.gpu.num_blocks,
            gpu_used=self.gpu.num_blocks - gpu_free_all,
            gpu_cached=self.gpu.num_cached_free,
            gpu_free=gpu_free_all - self.gpu.num_cached_free,
            cpu_total=self.cpu.num_blocks,
            cpu_used=self.cpu.num_blocks - cpu_free,
            cpu_free=cpu_free,
        )

    def slot_usage(self, seqs: Iterable[Sequence]) -> tuple[SlotUsage, SlotUsage]:
        """(GPU, CPU) token-slot usage of the blocks that `seqs` hold (sequences holding no
        blocks are skipped). A counting method: it changes nothing. O(blocks held).

        Safe to call from a collecting thread while the step thread runs: it reads each
        table once, as a copy, and tolerates a sequence freed in between."""
        return self._slot_usage(seqs, self.gpu_tables), self._slot_usage(seqs, self.cpu_tables)

    def _slot_usage(self, seqs: Iterable[Sequence], tables: dict[int, list[int]]) -> SlotUsage:
        bs = self.block_size
        filled: dict[int, int] = {}  # block id -> tokens in it (its fullest holder's count)
        holders: dict[int, int] = {}
        for seq in seqs:
            table = tables.get(seq.seq_id)
            if table is None:
                continue
            table = list(table)
            num_tokens = min(len(seq.token_ids), len(table) * bs)
            for i, bid in enumerate(table):
                if bid == NULL_BLOCK:
                    continue
                n = min(bs, max(0, num_tokens - i * bs))
                if n > filled.get(bid, -1):
                    filled[bid] = n
                holders[bid] = holders.get(bid, 0) + 1
        return SlotUsage(
            used_slots=sum(filled.values()),
            allocated_slots=len(filled) * bs,
            num_allocated_blocks=len(filled),
            num_shared_blocks=sum(1 for n in holders.values() if n > 1),
        )

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache

    def _match_prefix(self, token_ids: list[int], root_key: int | None = None) -> list[PhysicalBlock]:
        """The longest chain of cached full blocks that starts the sequence (`root_key`:
        the salted chain's, see salt_key).

        Only tokens[:-1] are looked up: the last token is always computed, so the step
        has at least one query to produce logits from.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[PhysicalBlock] = []
        parent: PhysicalBlock | None = None
        parent_key = root_key
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = self.hash_fn(parent_key, tokens)
            block = self.gpu.cached.get(key)
            if (
                block is None
                or block.token_ids != tokens
                or block.parent is not parent
                or (parent is not None and block.parent_generation != parent.generation)
            ):
                break
            hits.append(block)
            parent, parent_key = block, key
        return hits

    def _register_full_blocks(self, seq: Sequence, table: list[int], num_tokens: int) -> None:
        """Give every full block among the first `num_tokens` of `seq` (computed by the end
        of this step) a cache identity."""
        if not self.enable_prefix_caching:
            return
        start = self._num_registered.get(seq.seq_id, 0)
        end = num_tokens // self.block_size
        if start >= end:
            return
        if start <= self._num_released.get(seq.seq_id, 0) and table[0] == NULL_BLOCK:
            self._num_registered[seq.seq_id] = end  # a gap in the chain: nothing after it is findable
            return
        bs = self.block_size
        blocks = self.gpu.blocks
        parent = blocks[table[start - 1]] if start else None
        if parent is not None and parent.key is None:
            return  # the chain is broken (a duplicate): later blocks cannot be found either
        for i in range(start, end):
            block = blocks[table[i]]
            if block.key is None:
                tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                parent_key = self._salt_keys.get(seq.seq_id) if parent is None else parent.key
                key = self.hash_fn(parent_key, tokens)
                self.gpu.register(block, parent, key, tokens, parent_key)
                if self._fresh is not None:
                    self._fresh.add(block.block_id)
            parent = block
        self._num_registered[seq.seq_id] = end

    def cached_prefix_keys(self) -> list[int]:
        """Keys of every block the GPU prefix cache can hand out (in use or free but still
        cached). One C-level copy of the map's keys (ints: no Python code runs during
        it), so another thread may call this while the step thread runs."""
        return list(self.gpu.cached)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after a failed step left blocks uncomputed)."""
        self.gpu.reset_cache()
        if self.kv_offload:  # the failed step's copies may not have run
            self.cpu.reset_cache()
            self._restores, self._evicted, self._swapped_in = [], [], []
            for block in self._held:
                self.cpu.decref(block)
            self._held = []
            self._fresh.clear()
        self._num_registered = {sid: len(t) for sid, t in self.gpu_tables.items()}

    # ------------------------------------------------------------------ tier 2

    def _note_device_eviction(self, block: PhysicalBlock) -> None:
        self.counters.prefix_cache_evicted_blocks += 1
        if self._fresh is not None and block.block_id not in self._fresh:
            self._evicted.append((block.block_id, block.key, block.parent_key, block.token_ids))

    def _note_tier_eviction(self, block: PhysicalBlock) -> None:
        self.counters.offload_evicted_blocks += 1

    def _match_tier2(self, token_ids: list[int], start: int, parent_key: int | None) -> list[PhysicalBlock]:
        """Tier-2 blocks that continue a chain whose first `start` blocks are on the device
        (`parent_key`: the key of the last of them, or the root key)."""
        bs = self.block_size
        cached = self.cpu.cached
        hits: list[PhysicalBlock] = []
        for i in range(start, (len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = self.hash_fn(parent_key, tokens)
            block = cached.get(key)
            if block is None or block.token_ids != tokens or block.parent_key != parent_key:
                break
            hits.append(block)
            parent_key = key
        return hits

    def _restore(self, seq: Sequence, device_hits: list[PhysicalBlock], root_key: int | None) -> list[int]:
        """New device blocks for the tier-2 continuation of the sequence's device hits, their
        copies queued for this step's swap-in list. Their sources are held to the step's end."""
        parent_key = device_hits[-1].key if device_hits else root_key
        table = []
        for source in self._match_tier2(seq.token_ids, len(device_hits), parent_key):
            self.cpu.hold(source)
            self._held.append(source)
            block = self.gpu.allocate()
            self._restores.append((source.block_id, block.block_id))
            table.append(block.block_id)
        self.counters.restored_blocks += len(table)
        self.counters.offload_hits += len(table) * self.block_size
        return table

    def take_tier_copies(self) -> tuple[BlockMapping, BlockMapping]:
        """The step's tier-2 copies: (offloads as (gpu id, cpu id), restores as (cpu id,
        gpu id)), for the swap-out and swap-in lists. Called once, at the end of a step's
        scheduling: CPU places for this step's evicted device blocks are taken only now,
        from blocks no copy of this step reads."""
        if self._fresh is None:
            return [], []
        cpu = self.cpu
        held = self._held
        for bid in dict.fromkeys(self._swapped_in):
            held.append(cpu.blocks[bid])
            cpu.hold(held[-1])
        offloads: BlockMapping = []
        for gpu_bid, key, parent_key, tokens in self._evicted:
            entry = cpu.cached.get(key)
            if entry is not None and entry.token_ids == tokens and entry.parent_key == parent_key:
                if entry.ref_count == 0:  # already in tier 2: now its most recently used entry
                    cpu.free_queue.remove(entry)
                    cpu.free_queue.append(entry)
                continue
            if entry is not None or not cpu.free_queue.num_blocks:
                continue  # a different block under that key, or every CPU block held
            block = cpu.allocate()
            cpu.register(block, None, key, tokens, parent_key)
            cpu.decref(block)  # ref 0 and cached: the most recently used tier-2 entry
            offloads.append((gpu_bid, block.block_id))
        for block in held:
            cpu.decref(block)
        self.counters.offloaded_blocks += len(offloads)
        restores = self._restores
        self._restores, self._evicted, self._swapped_in, self._held = [], [], [], []
        self._fresh.clear()
        return offloads, restores

    def offload_prefix_keys(self) -> list[int]:
        """Keys of every tier-2 block (as cached_prefix_keys, for the router)."""
        return list(self.cpu.cached)

    # ------------------------------------------------------------------ admission

    def _plan(self, group: SequenceGroup) -> tuple[list[Sequence], list[list[PhysicalBlock]], int, int]:
        """(waiting seqs, each one's prefix hits, prompt blocks shared by all, blocks needed).

        A recomputed group's sequences share their prompt's full blocks again (the first
        computes what is not cached); each also takes its own cached blocks past the prompt.
        A group that asks for prompt logprobs or pools looks nothing up: every prompt
        token's logits or hidden state come from its own prefill.
        """
        seqs = group.get_seqs(SequenceStatus.WAITING)
        first = seqs[0]
        root_key = group_root_key(group)
        match = _no_match if group.sampling_params.is_full_prefill else self._match_prefix
        hits = [match(first.token_ids, root_key)]
        num_shared = first.num_prompt_tokens // self.block_size if len(seqs) > 1 else 0
        total = self._num_blocks_for(len(first))
        for seq in seqs[1:]:
            own_hits = match(seq.token_ids, root_key)[num_shared:]
            hits.append(own_hits)
            total += self._num_blocks_for(len(seq)) - num_shared
        return seqs, hits, num_shared, total

    def can_allocate(self, group: SequenceGroup, use_watermark: bool = True) -> AllocStatus:
        """NEVER only when the group needs more blocks than the pool has. The watermark
        (kept free against thrashing between groups) does not apply to a group that will
        run alone: `use_watermark=False`."""
        seqs, hits, _, total = self._plan(group)
        if total > self.gpu.num_blocks:
            return AllocStatus.NEVER
        # Hits already in use cost nothing; hits in the free queue and new blocks cost one each.
        need = total - len({b.block_id for seq_hits in hits for b in seq_hits if b.ref_count > 0})
        reserve = self.watermark_blocks if use_watermark else 0
        if self.gpu.num_free_blocks - need >= reserve:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        """Give the group's waiting sequences block tables; sets their computed-token counts
        (the prefix-cache hits). Blocks cover every token: a chunked prefill needs no more."""
        seqs, hits, num_shared, _ = self._plan(group)
        root_key = group_root_key(group)
        if root_key is not None:
            self._salt_keys.update((seq.seq_id, root_key) for seq in seqs)
        for seq_hits in hits:  # every hit is taken before any allocation may evict one
            for block in seq_hits:
                self.gpu.reuse(block)
        first = seqs[0]
        table = [b.block_id for b in hits[0]]
        if self.kv_offload and len(seqs) == 1 and not group.sampling_params.is_full_prefill:
            table += self._restore(first, hits[0], root_key)
        num_computed = len(table) * self.block_size
        table += [self.gpu.allocate().block_id for _ in range(self._num_blocks_for(len(first)) - len(table))]
        self._start_table(first, table, num_computed=num_computed)
        self.counters.prefix_cache_queries += len(first)
        self.counters.prefix_cache_hits += len(hits[0]) * self.block_size
        for seq, own_hits in zip(seqs[1:], hits[1:]):
            shared = table[:num_shared]
            for bid in shared:
                self.gpu.incref(self.gpu.blocks[bid])
            own = [b.block_id for b in own_hits]
            own += [self.gpu.allocate().block_id for _ in range(self._num_blocks_for(len(seq)) - num_shared - len(own))]
            self._start_table(seq, shared + own, num_computed=(num_shared + len(own_hits)) * self.block_size)

    def _start_table(self, seq: Sequence, table: list[int], num_computed: int) -> None:
        self.gpu_tables[seq.seq_id] = table
        self._num_registered[seq.seq_id] = 0
        self._num_released.pop(seq.seq_id, None)
        seq.num_computed_tokens = num_computed
        self._register_full_blocks(seq, table, num_computed)

    def mark_computed(self, seq: Sequence, num_tokens: int) -> list[int]:
        """The block table of a prefilling sequence whose first `num_tokens` are computed by
        the end of this step (its blocks were allocated at admission); their full blocks
        become prefix-cache entries."""
        table = self.gpu_tables[seq.seq_id]
        self._register_full_blocks(seq, table, num_tokens)
        return table

    # ------------------------------------------------------------------ decode

    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Whether every running sequence of the group can get a slot for its next token.

        Exact for forks: when all k holders of a shared last block are in this group, the
        last of them to write finds it unshared, so k - 1 copies are made, not k.
        """
        need = 0
        shared_last: dict[int, int] = {}  # shared last block id -> holders in this group
        tables = self.gpu_tables
        blocks = self.gpu.blocks
        for seq in group.seqs:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            table = tables[seq.seq_id]
            if len(table) * self.block_size < len(seq.token_ids):
                need += 1
            elif blocks[table[-1]].ref_count > 1:
                shared_last[table[-1]] = shared_last.get(table[-1], 0) + 1
        for bid, holders in shared_last.items():
            need += holders - 1 if blocks[bid].ref_count == holders else holders
        return need <= self.gpu.num_free_blocks

    def append_slots(self, seq: Sequence, blocks_to_copy: BlockMapping, num_lookahead: int = 0) -> list[int]:
        """Make room for the sequence's uncomputed tokens (copy-on-write if shared), and
        for `num_lookahead` draft tokens past them (speculative decoding: `roll_back`
        returns the rejected drafts' blocks); returns its block table. On every decode
        step of every sequence: kept lean. Only tokens of the sequence get prefix-cache
        identities, never drafts."""
        table = self.gpu_tables[seq.seq_id]
        num_tokens = len(seq.token_ids)
        bs = self.block_size
        if len(table) * bs < num_tokens:
            while len(table) * bs < num_tokens:
                table.append(self.gpu.allocate().block_id)
        else:
            last = self.gpu.blocks[table[-1]]
            if last.ref_count > 1:
                # The slot to write sits in a block other sequences still read: copy it first.
                copy = self.gpu.allocate()
                self.gpu.decref(last)
                table[-1] = copy.block_id
                blocks_to_copy.append((last.block_id, copy.block_id))
                self.counters.copy_on_write_blocks += 1
        if num_lookahead:
            while len(table) * bs < num_tokens + num_lookahead:
                table.append(self.gpu.allocate().block_id)
        if num_tokens % bs == 0:
            self._register_full_blocks(seq, table, num_tokens)
        if self.sliding_window is not None and num_tokens > self.sliding_window:
            self._release_outside_window(seq.seq_id, table, num_tokens)
        return table

    def roll_back(self, seq: Sequence, num_computed: int) -> list[int]:
        """Speculative decoding verified the sequence's drafts: its first `num_computed`
        tokens (the accepted drafts among them) hold K/V. Blocks past them go back to the
        pool, tail first (they were never registered: no cached identity is lost); the full
        blocks of accepted tokens become prefix-cache entries. Returns its block table.

            before   [t0 .. t15][t16 t17 d1 d2 ][d3 d4 .  .  ]    4 drafts, 1 accepted
            after    [t0 .. t15][t16 t17 d1 x  ]                  x: the token drawn next
        """
        table = self.gpu_tables[seq.seq_id]
        keep = max(self._num_blocks_for(num_computed), self._num_released.get(seq.seq_id, 0))
        while len(table) > keep:
            self.gpu.decref(self.gpu.blocks[table.pop()])
        self._register_full_blocks(seq, table, num_computed)
        return table

    def _release_outside_window(self, seq_id: int, table: list[int], num_tokens: int) -> None:
        """The query at position num_tokens - 1 sees positions >= num_tokens - window: the
        blocks wholly before that go back to the pool (O(1) per step, amortised)."""
        start = self._num_released.get(seq_id, 0)
        end = (num_tokens - self.sliding_window) // self.block_size  # blocks [0, end) are unseen
        if end <= start:
            return
        blocks = self.gpu.blocks
        for i in range(end - 1, start - 1, -1):  # the later ones first, as free() does
            self.gpu.decref(blocks[table[i]])
            table[i] = NULL_BLOCK
        self._num_released[seq_id] = end

    def num_held_blocks(self, seq: Sequence) -> int:
        """GPU blocks the sequence's table holds (its released entries not counted)."""
        table = self.gpu_tables[seq.seq_id]
        return len(table) - self._num_released.get(seq.seq_id, 0)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (reference counts go up)."""
        table = self.gpu_tables[parent.seq_id]
        for bid in table:
            if bid != NULL_BLOCK:
                self.gpu.incref(self.gpu.blocks[bid])
        self.gpu_tables[child.seq_id] = list(table)
        self._num_registered[child.seq_id] = self._num_registered.get(parent.seq_id, 0)
        if parent.seq_id in self._salt_keys:
            self._salt_keys[child.seq_id] = self._salt_keys[parent.seq_id]
        if parent.seq_id in self._num_released:
            self._num_released[child.seq_id] = self._num_released[parent.seq_id]

    # ------------------------------------------------------------------ free

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks on whichever device holds them (tail first, so the
        LRU queue evicts a prefix's later blocks before its first ones)."""
        table = self.gpu_tables.pop(seq.seq_id, None)
        if table is not None:
            for bid in reversed(table):
                if bid != NULL_BLOCK:
                    self.gpu.decref(self.gpu.blocks[bid])
        table = self.cpu_tables.pop(seq.seq_id, None)
        if table is not None:
            for bid in reversed(table):
                if bid != NULL_BLOCK:
                    self.cpu.decref(self.cpu.blocks[bid])
        self._num_registered.pop(seq.seq_id, None)
        self._salt_keys.pop(seq.seq_id, None)
        self._num_released.pop(seq.seq_id, None)

    # ------------------------------------------------------------------ swapping

    def _distinct_blocks(self, tables: list[list[int]]) -> list[int]:
        return list(dict.fromkeys(bid for table in tables for bid in table if bid != NULL_BLOCK))

    def can_swap_out(self, group: SequenceGroup) -> bool:
        tables = [self.gpu_tables[s.seq_id] for s in group.get_seqs(SequenceStatus.RUNNING)]
        return len(self._distinct_blocks(tables)) <= self.cpu.num_free_blocks

    def swap_out(self, group: SequenceGroup) -> BlockMapping:
        """Move the group's blocks to the CPU pool; returns (gpu id, cpu id) pairs to copy."""
        return self._move(group, SequenceStatus.RUNNING, self.gpu, self.cpu, self.gpu_tables, self.cpu_tables)

    def _resident_blocks(self, seqs: list[Sequence]) -> dict[int, PhysicalBlock]:
        """CPU block id -> the GPU block that still holds the same computed full block of a
        prefix (shared with other groups, or cached): swap-in takes it instead of a copy."""
        resident: dict[int, PhysicalBlock] = {}
        for seq in seqs:
            hits = self._match_prefix(seq.token_ids, self._salt_keys.get(seq.seq_id))
            hits = hits[: seq.num_computed_tokens // self.block_size]
            for cpu_bid, block in zip(self.cpu_tables[seq.seq_id], hits):
                if cpu_bid != NULL_BLOCK:
                    resident.setdefault(cpu_bid, block)
        return resident

    def can_swap_in(self, group: SequenceGroup, use_watermark: bool = True) -> bool:
        """With the watermark, each sequence may also need a block for the token it computes
        in the same step. A group that will run alone (`use_watermark=False`) only needs its
        blocks to fit; the scheduler then makes room for its growth."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        cpu_bids = self._distinct_blocks([self.cpu_tables[s.seq_id] for s in seqs])
        resident = self._resident_blocks(seqs)
        in_use = {b.block_id for b in resident.values() if b.ref_count > 0}
        need = len(cpu_bids) - sum(1 for bid in cpu_bids if bid in resident and resident[bid].block_id in in_use)
        if use_watermark:
            return self.gpu.num_free_blocks - need - len(seqs) >= self.watermark_blocks
        return self.gpu.num_free_blocks - need >= 0

    def swap_in(self, group: SequenceGroup) -> BlockMapping:
        """Bring the group's blocks back; returns (cpu id, gpu id) pairs to copy. Blocks of a
        prefix still on the GPU are taken as they are, not copied."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        resident = self._resident_blocks(seqs)
        mapping: dict[int, int] = {}
        for cpu_bid, block in resident.items():  # before any allocation may evict one
            self.gpu.reuse(block)
            mapping[cpu_bid] = block.block_id
        first_use_taken = set(resident)  # their first reference was taken above
        copies = []
        for seq in seqs:
            table = []
            for bid in self.cpu_tables.pop(seq.seq_id):
                if bid == NULL_BLOCK:
                    table.append(NULL_BLOCK)
                    continue
                gpu_bid = mapping.get(bid)
                if gpu_bid is None:
                    gpu_bid = mapping[bid] = self.gpu.allocate().block_id
                    copies.append((bid, gpu_bid))
                elif bid in first_use_taken:
                    first_use_taken.discard(bid)
                else:
                    self.gpu.incref(self.gpu.blocks[gpu_bid])
                table.append(gpu_bid)
                self.cpu.decref(self.cpu.blocks[bid])
            self.gpu_tables[seq.seq_id] = table
        self.counters.swapped_in_blocks += len(copies)
        if self.kv_offload:
            self._swapped_in.extend(bid for bid, _ in copies)
        for seq in seqs:
            # Fresh GPU blocks get their identities again (the group runs this step).
            self._num_registered[seq.seq_id] = 0
            self._register_full_blocks(seq, self.gpu_tables[seq.seq_id], seq.num_computed_tokens)
        return copies

    def _move(self, group, status, src: DeviceAllocator, dst: DeviceAllocator, src_tables, dst_tables) -> BlockMapping:
        mapping: dict[int, int] = {}
        for seq in group.get_seqs(status):
            new_table = []
            for bid in src_tables.pop(seq.seq_id):
                if bid == NULL_BLOCK:
                    new_table.append(NULL_BLOCK)
                    continue
                if bid in mapping:
                    dst.incref(dst.blocks[mapping[bid]])
                else:
                    mapping[bid] = dst.allocate().block_id
                new_table.append(mapping[bid])
                src.decref(src.blocks[bid])
            dst_tables[seq.seq_id] = new_table
        if dst is self.cpu:
            self.counters.swapped_out_blocks += len(mapping)
        else:
            self.counters.swapped_in_blocks += len(mapping)
        return list(mapping.items())
