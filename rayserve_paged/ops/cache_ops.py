"""KV-cache writes and whole-block moves (torch; correct on any device).

Cache layout, per layer, for keys and values alike:

    cache [num_blocks, block_size, num_kv_heads, head_dim]
    slot  = block_id * block_size + offset      (a row of cache.view(-1, num_kv_heads, head_dim))

Every public function checks shapes, dtypes and devices first and raises ValueError naming
the problem; nothing here loops in Python per token, and block moves are batched per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from .attention import PAD_SLOT

BlockMapping = Sequence[tuple[int, int]] | torch.Tensor  # (src, dst) pairs, or int64 [N, 2]
KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache) of one layer


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The slot of a sequence's token at `position`, through its block table (the layout above)."""
    return block_table[position // block_size] * block_size + position % block_size


# ---------------------------------------------------------------------------- reshape_and_cache


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token i's key/value into slot `slot_mapping[i]` of the caches; skip PAD_SLOT."""
    _check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    write_slots(key, value, key_cache, value_cache, slot_mapping)


def cpu_slot_writes(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the real tokens' slots, the mask of real tokens or None when every token is real): what
    write_slots writes on the CPU, the same for every layer of a step."""
    # boolean indexing sizes its result on the host: free on CPU, a device sync elsewhere
    is_real = slot_mapping != PAD_SLOT  # [num_tokens]
    if bool(is_real.all()):
        return slot_mapping, None
    return slot_mapping[is_real], is_real  # [num_real_tokens], [num_tokens]


def write_slots(key, value, key_cache, value_cache, slot_mapping, cpu_writes=None) -> None:
    """reshape_and_cache without its checks, for callers that checked the same shapes, dtypes
    and devices already (the attention backends, once per step). `cpu_writes`: the step's
    cpu_slot_writes(slot_mapping), computed once for all its layers (CPU caches only)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    flat_key, flat_value = key_cache.view(flat_shape), value_cache.view(flat_shape)
    if key_cache.device.type == "cpu":
        slots, is_real = cpu_writes if cpu_writes is not None else cpu_slot_writes(slot_mapping)
        flat_key.index_copy_(0, slots, key if is_real is None else key[is_real])
        flat_value.index_copy_(0, slots, value if is_real is None else value[is_real])
        return
    _write_fixed_shape(key, value, flat_key, flat_value, slot_mapping)


def _write_fixed_shape(key, value, flat_key, flat_value, slot_mapping) -> None:
    """reshape_and_cache on CUDA: the same bytes as the masked copy, without a device sync."""
    slots, source, is_write = _padding_free_writes(slot_mapping)
    for flat, new in ((flat_key, key), (flat_value, value)):
        rows = torch.where(is_write[:, None, None], new.index_select(0, source), flat[:1])  # [num_tokens, kv, d]
        flat.index_copy_(0, slots, rows)


def _padding_free_writes(slot_mapping: torch.Tensor):
    """(slots, source tokens, is_write) that write exactly what the masked copy writes, with
    fixed shapes and so without a device sync. A PAD_SLOT token is redirected to the slot of
    the nearest real token before it (or the first real token) and carries that token's
    key/value: the slot receives the same bytes twice, so the order of the duplicate writes
    does not matter. With no real token at all, every token rewrites slot 0 with its own
    current contents (is_write False)."""
    num_tokens = slot_mapping.shape[0]
    is_real = slot_mapping != PAD_SLOT  # [num_tokens]
    index = torch.arange(num_tokens, device=slot_mapping.device)
    previous_real = torch.where(is_real, index, -1).cummax(0).values  # [num_tokens]; -1 before the first
    first_real = is_real.to(torch.int8).argmax()  # 0 when there is none
    source = torch.where(previous_real >= 0, previous_real, first_real)  # [num_tokens]
    is_write = is_real.index_select(0, source)  # False only when no token is real
    slots = torch.where(is_write, slot_mapping.index_select(0, source), 0)
    return slots, source, is_write


def _check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    _require(key.dim() == 3, f"key must be [num_tokens, num_kv_heads, head_dim], got {_shape(key)}")
    _require(value.shape == key.shape, f"value shape {_shape(value)} != key shape {_shape(key)}")
    _check_cache_pair(key_cache, value_cache)
    _require(
        key_cache.shape[2:] == key.shape[1:],
        f"key [num_tokens, num_kv_heads, head_dim] = {_shape(key)} does not fit key_cache "
        f"[num_blocks, block_size, num_kv_heads, head_dim] = {_shape(key_cache)}",
    )
    _require(
        slot_mapping.shape == (key.shape[0],),
        f"slot_mapping must be [num_tokens={key.shape[0]}], got {_shape(slot_mapping)}",
    )
    _require(slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}")
    _require_same_dtype(("key", key), ("value", value), ("key_cache", key_cache))
    _require_same_device(
        ("key", key), ("value", value), ("key_cache", key_cache), ("slot_mapping", slot_mapping)
    )


# ---------------------------------------------------------------------------- copy_blocks


def copy_blocks(kv_caches: Sequence[KVCache], block_mapping: BlockMapping) -> None:
    """Copy whole blocks src -> dst in every layer's key and value cache (copy-on-write).

    All sources are read before any destination is written, so a dst that is also a src
    in the same mapping receives the block's old contents; dst ids must be distinct.
    """
    if not kv_caches:
        raise ValueError("copy_blocks: kv_caches is empty (expected one (key, value) per layer)")
    for layer, (key_cache, value_cache) in enumerate(kv_caches):
        _check_cache_pair(key_cache, value_cache, where=f"layer {layer}")
        _require_same_layout(kv_caches[0][0], key_cache, f"layer {layer}", "layer 0")
    first = kv_caches[0][0]
    src, dst = _mapping_to_index(block_mapping, first.shape[0], first.device)
    if src.numel() == 0:
        return
    for key_cache, value_cache in kv_caches:
        key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
        value_cache.index_copy_(0, dst, value_cache.index_select(0, src))


# ---------------------------------------------------------------------------- swap_blocks


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: BlockMapping) -> None:
    """Copy whole blocks src_cache[s] -> dst_cache[d] for each (s, d), e.g. GPU <-> pinned CPU.

    Copies across devices are issued with non_blocking=True: the caller synchronises once
    per step (torch.cuda.synchronize / a stream event) before reading dst_cache or reusing
    the source blocks.
    """
    _check_swap_pair(src_cache, dst_cache, "src_cache", "dst_cache")
    pairs = _mapping_to_pairs(block_mapping)
    _check_block_ids(pairs, src_cache.shape[0], dst_cache.shape[0])
    if pairs:
        _swap_tensor(src_cache, dst_cache, pairs)


def swap_kv_blocks(
    src_kv_caches: Sequence[KVCache], dst_kv_caches: Sequence[KVCache], block_mapping: BlockMapping
) -> None:
    """swap_blocks for every layer's key and value cache (one mapping for all layers)."""
    _require(
        len(src_kv_caches) == len(dst_kv_caches),
        f"swap_kv_blocks: {len(src_kv_caches)} source layers but {len(dst_kv_caches)} destination layers",
    )
    for layer, (src_pair, dst_pair) in enumerate(zip(src_kv_caches, dst_kv_caches)):
        for name, src, dst in zip(("key_cache", "value_cache"), src_pair, dst_pair):
            _check_swap_pair(src, dst, f"layer {layer} source {name}", f"layer {layer} destination {name}")
    pairs = _mapping_to_pairs(block_mapping)
    if not pairs or not src_kv_caches:
        return
    _check_block_ids(pairs, src_kv_caches[0][0].shape[0], dst_kv_caches[0][0].shape[0])
    for src_pair, dst_pair in zip(src_kv_caches, dst_kv_caches):
        for src, dst in zip(src_pair, dst_pair):
            _swap_tensor(src, dst, pairs)


def _swap_tensor(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """One batched gather on the source device, then one transfer (or one per dst run)."""
    if src.device == dst.device:
        src_ids, dst_ids = _index_pair(pairs, src.device, dst.device)
        dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))
    elif dst.device.type == "cpu":
        _swap_to_host(src, dst, pairs)
    else:
        _swap_to_device(src, dst, pairs)


def _swap_to_host(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    # An async device->host copy cannot be followed by a host-side index_copy_ (it would read
    # the staging buffer before the copy lands), so copy straight into runs of consecutive
    # destination blocks: one transfer per run, in order on the source device's stream.
    pairs = sorted(pairs, key=lambda pair: pair[1])
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.int64).to(src.device)  # [num_pairs]
    staged = src.index_select(0, src_ids)  # [num_pairs, block_size, num_kv_heads, head_dim]
    for start, dst_start, length in contiguous_runs([d for _, d in pairs]):
        dst[dst_start : dst_start + length].copy_(staged[start : start + length], non_blocking=True)


def _swap_to_device(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    src_ids, dst_ids = _index_pair(pairs, src.device, dst.device)
    # From the host, gather into a pinned buffer so the copy to the device is truly
    # asynchronous; the caching host allocator keeps it alive until the copy has run.
    pin = src.device.type == "cpu" and dst.device.type == "cuda"
    staged = torch.empty(
        (len(pairs), *src.shape[1:]), dtype=src.dtype, device=src.device, pin_memory=pin
    )  # [num_pairs, block_size, num_kv_heads, head_dim]
    torch.index_select(src, 0, src_ids, out=staged)
    dst.index_copy_(0, dst_ids, staged.to(dst.device, non_blocking=True))


class BlockSwapper:
    """Swaps whole blocks of every layer between the device cache and the (pinned) host pool,
    off the compute stream and with no host sync inside a step: for each run of pairs whose
    source and destination ids are both consecutive, one non-blocking copy per cache tensor
    straight between the two pools. No staging buffer (nothing to reserve in the KV sizing),
    no host-side gather, no allocation per call; the copies run on a side stream:

        swap_out(pairs)  device -> host. The side stream first waits for the compute stream
                         (blocks written by earlier steps), copies each run, then the compute
                         stream waits for it (the step may overwrite the source blocks once
                         they are read). The host pool holds the blocks once the copies have
                         run: finish() waits for them, at the start of the next step (or
                         before a swap-in reads the pool).
        swap_in(pairs)   host -> device. finish() first; the side stream copies each run into
                         the device cache; the compute stream waits before the step's kernels.

    Copies from a pinned pool are asynchronous; the swap stream keeps every swap in issue
    order, so a host block read by a swap-in is not overwritten by a later swap-out before
    the read. On CPU the same code runs without streams or events. The caller orders the
    calls as the worker does: finish(), swap_out, swap_in, then the step. `num_copies` and
    `num_runs` count what was issued.
    """

    def __init__(self, device_caches: Sequence[KVCache], host_caches: Sequence[KVCache]) -> None:
        _require(
            len(device_caches) == len(host_caches),
            f"BlockSwapper: {len(device_caches)} device layers but {len(host_caches)} host layers",
        )
        self.device_caches = list(device_caches)
        self.device_tensors = [t for pair in device_caches for t in pair]  # 2 x layers
        self.host_tensors = [t for pair in host_caches for t in pair]
        for index, (device_tensor, host_tensor) in enumerate(zip(self.device_tensors, self.host_tensors)):
            _check_swap_pair(device_tensor, host_tensor, f"device cache {index}", f"host cache {index}")
        self.device = self.device_tensors[0].device if self.device_tensors else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.compute_stream = None
        self.pending: list = []  # events of swap-outs whose copies into the host pool may still run
        self.num_copies = 0  # copies issued (one per run per cache tensor)
        self.num_runs = 0  # runs of consecutive (src, dst) ids swapped

    def move(self, swap_out: BlockMapping, swap_in: BlockMapping, copies: BlockMapping) -> None:
        """One step's block moves in the worker's order: blocks swapped out this step may be
        handed to swap-ins and copies; last step's swap-outs land in the host pool first."""
        self.finish()
        if swap_out:
            self.swap_out(swap_out)
        if swap_in:
            self.swap_in(swap_in)
        if copies:
            copy_blocks(self.device_caches, copies)

    def swap_out(self, block_mapping: BlockMapping) -> None:
        runs = self._runs(block_mapping, self._num_blocks(self.device_tensors), self._num_blocks(self.host_tensors))
        if not runs:
            return
        with self._side_stream():
            self._copy_runs(self.device_tensors, self.host_tensors, runs)
            self._compute_waits()  # the sources are read: the step may overwrite them
            self.pending.append(self._record())

    def swap_in(self, block_mapping: BlockMapping) -> None:
        self.finish()  # the host pool must hold every block swapped out before
        runs = self._runs(block_mapping, self._num_blocks(self.host_tensors), self._num_blocks(self.device_tensors))
        if not runs:
            return
        with self._side_stream():
            self._copy_runs(self.host_tensors, self.device_tensors, runs)
            self._compute_waits()

    def finish(self) -> None:
        """Wait until earlier swap-outs have landed in the host pool."""
        for landed in self.pending:
            if landed is not None:
                landed.synchronize()
        self.pending.clear()

    def _copy_runs(self, sources: list[torch.Tensor], destinations: list[torch.Tensor], runs) -> None:
        for src_start, dst_start, length in runs:
            for src, dst in zip(sources, destinations):
                dst[dst_start : dst_start + length].copy_(src[src_start : src_start + length], non_blocking=True)
        self.num_copies += len(runs) * len(sources)
        self.num_runs += len(runs)

    @staticmethod
    def _num_blocks(tensors: list[torch.Tensor]) -> int:
        return len(tensors[0]) if tensors else 0

    @staticmethod
    def _runs(block_mapping: BlockMapping, num_src: int, num_dst: int) -> list[tuple[int, int, int]]:
        """The checked pairs as (first src, first dst, length) runs where both ids are
        consecutive, in source order."""
        pairs = _mapping_to_pairs(block_mapping)
        _check_block_ids(pairs, num_src, num_dst)
        runs: list[tuple[int, int, int]] = []
        for src, dst in sorted(pairs):
            if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((src, dst, 1))
        return runs

    def _side_stream(self):
        if not self.cuda:
            return contextlib.nullcontext()
        self.compute_stream = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(self.compute_stream)  # blocks written by earlier steps
        return torch.cuda.stream(self.stream)

    def _compute_waits(self) -> None:
        """The compute stream (current when the swap was called) waits, on the GPU, for what the
        side stream has issued so far."""
        if self.cuda:
            self.compute_stream.wait_event(self._record())

    def _record(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def contiguous_runs(dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split dst ids into runs of consecutive ids: [(position, first_id, length), ...].

    >>> contiguous_runs([4, 5, 6, 9, 2, 3])
    [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    """
    runs: list[tuple[int, int, int]] = []
    for position, block_id in enumerate(dst_ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((position, block_id, 1))
    return runs


# ---------------------------------------------------------------------------- block mappings


def _mapping_to_pairs(block_mapping: BlockMapping) -> list[tuple[int, int]]:
    if isinstance(block_mapping, torch.Tensor):
        _check_mapping_tensor(block_mapping)
        return [(int(s), int(d)) for s, d in block_mapping.tolist()]
    pairs = []
    for pair in block_mapping:
        _require(len(pair) == 2, f"block_mapping entries must be (src, dst) pairs, got {pair!r}")
        pairs.append((int(pair[0]), int(pair[1])))
    return pairs


def _mapping_to_index(block_mapping: BlockMapping, num_blocks: int, device: torch.device):
    """(src ids, dst ids) as int64 tensors on `device`; host-side mappings are range-checked."""
    if isinstance(block_mapping, torch.Tensor) and block_mapping.device.type != "cpu":
        _check_mapping_tensor(block_mapping)  # ids stay on the device: no sync to check them
        mapping = block_mapping.to(device)  # [num_pairs, 2]
        return mapping[:, 0], mapping[:, 1]
    pairs = _mapping_to_pairs(block_mapping)
    _check_block_ids(pairs, num_blocks, num_blocks)
    return _index_pair(pairs, device, device)


def _index_pair(pairs: list[tuple[int, int]], src_device: torch.device, dst_device: torch.device):
    mapping = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)  # [num_pairs, 2]
    return mapping[:, 0].to(src_device), mapping[:, 1].to(dst_device)


def _check_mapping_tensor(mapping: torch.Tensor) -> None:
    _require(
        mapping.dim() == 2 and mapping.shape[1] == 2,
        f"block_mapping tensor must be [num_pairs, 2], got {_shape(mapping)}",
    )
    _require(mapping.dtype == torch.int64, f"block_mapping tensor must be int64, got {mapping.dtype}")


def _check_block_ids(pairs: list[tuple[int, int]], num_src: int, num_dst: int) -> None:
    for src, dst in pairs:
        _require(0 <= src < num_src, f"block_mapping source block {src} is outside [0, {num_src})")
        _require(0 <= dst < num_dst, f"block_mapping destination block {dst} is outside [0, {num_dst})")
    dsts = [dst for _, dst in pairs]
    _require(len(set(dsts)) == len(dsts), f"block_mapping has repeated destination blocks: {dsts}")


# ---------------------------------------------------------------------------- checks


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor, where: str = "") -> None:
    prefix = f"{where}: " if where else ""
    _require(
        key_cache.dim() == 4,
        f"{prefix}key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {_shape(key_cache)}",
    )
    _require(
        value_cache.shape == key_cache.shape,
        f"{prefix}value_cache shape {_shape(value_cache)} != key_cache shape {_shape(key_cache)}",
    )
    _require(
        key_cache.dtype == value_cache.dtype,
        f"{prefix}value_cache dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}",
    )
    _require(
        key_cache.device == value_cache.device,
        f"{prefix}value_cache is on {value_cache.device} but key_cache is on {key_cache.device}",
    )
    _require(
        key_cache.is_contiguous() and value_cache.is_contiguous(),
        f"{prefix}key_cache and value_cache must be contiguous",
    )


def _check_swap_pair(src: torch.Tensor, dst: torch.Tensor, src_name: str, dst_name: str) -> None:
    _require(
        src.dim() == 4 and dst.dim() == 4,
        f"{src_name} {_shape(src)} and {dst_name} {_shape(dst)} must both be "
        "[num_blocks, block_size, num_kv_heads, head_dim]",
    )
    _require(
        src.shape[1:] == dst.shape[1:],
        f"{src_name} block shape {_shape(src)[1:]} != {dst_name} block shape {_shape(dst)[1:]}",
    )
    _require(src.dtype == dst.dtype, f"{src_name} dtype {src.dtype} != {dst_name} dtype {dst.dtype}")
    _require(
        src.is_contiguous() and dst.is_contiguous(), f"{src_name} and {dst_name} must be contiguous"
    )


def _require_same_layout(expected: torch.Tensor, got: torch.Tensor, got_name: str, expected_name: str):
    _require(
        got.shape == expected.shape,
        f"{got_name} cache shape {_shape(got)} != {expected_name} cache shape {_shape(expected)}",
    )
    _require(
        got.dtype == expected.dtype, f"{got_name} dtype {got.dtype} != {expected_name} dtype {expected.dtype}"
    )
    _require(
        got.device == expected.device,
        f"{got_name} is on {got.device} but {expected_name} is on {expected.device}",
    )


def _require_same_dtype(*named: tuple[str, torch.Tensor]) -> None:
    first_name, first = named[0]
    for name, tensor in named[1:]:
        _require(
            tensor.dtype == first.dtype, f"{name} dtype {tensor.dtype} != {first_name} dtype {first.dtype}"
        )


def _require_same_device(*named: tuple[str, torch.Tensor]) -> None:
    first_name, first = named[0]
    for name, tensor in named[1:]:
        _require(
            tensor.device == first.device,
            f"{name} is on {tensor.device} but {first_name} is on {first.device}",
        )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)
