"""Per-rank memory figures: taken in each worker, recorded in the scheduler actor.

    worker (rank r)                               scheduler actor
    GpuProbe.snapshot(kv, cpu) -> GpuSnapshot ──> GpuMetrics.update([snapshot dicts])
      NVML: device used / free / total, SM %       observable gauges over the latest
      torch allocator: allocated / reserved / peak  snapshots, labelled replica, tp_rank,
      bytes of the KV cache and CPU swap tensors    gpu_index, hw.id, hw.name

A snapshot is plain data (ints, strs, None), so it crosses Ray as a dict. NVML and the torch
allocator are optional: a field is None when its source is absent, and GpuMetrics observes
nothing for None, so those instruments simply do not appear. The cache bytes always do.

NVML reaches the probe through a seam: `nvml` is any object with pynvml's function names
(nvmlInit, nvmlDeviceGetHandleByIndex, ...); by default `pynvml`, imported lazily.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from rayserve_paged.telemetry import names

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GpuSnapshot:
    """One TP rank's memory at one moment. Bytes are ints; None = source unavailable."""

    rank: int
    device: str  # "cuda:0" as the worker's torch sees it, or "cpu"
    kv_cache_bytes: int = 0  # the device KV cache tensors, all layers, K and V
    cpu_swap_bytes: int = 0  # the CPU swap pool tensors
    # NVML (the whole device, every process on it)
    gpu_index: int | None = None  # NVML index, as nvidia-smi numbers GPUs
    gpu_uuid: str | None = None
    gpu_name: str | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization: float | None = None  # 0..1, SM busy time over NVML's last sample period
    # torch's caching allocator (this process only)
    torch_allocated_bytes: int | None = None
    torch_reserved_bytes: int | None = None
    torch_peak_allocated_bytes: int | None = None  # since the last reset_peak_memory_stats

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuSnapshot:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def tensor_bytes(caches: Iterable) -> int:
    """Bytes of a worker's caches: a list of per-layer (key, value) tensor pairs."""
    return sum(t.numel() * t.element_size() for pair in caches for t in pair)


def cuda_ordinal(device) -> int | None:
    """The CUDA ordinal of a torch device, "cuda:N" string or int; None for a non-CUDA device."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        return (int(index) if index else 0) if kind == "cuda" else None
    if getattr(device, "type", None) == "cuda":
        return device.index if device.index is not None else 0
    return None


class GpuProbe:
    """Takes GpuSnapshots for one TP rank. Never raises: a missing or failing NVML turns the
    NVML fields into None, with one log line per probe saying why."""

    def __init__(
        self, rank: int, device="cuda:0", *, nvml=None, torch_cuda=None, environ: Mapping[str, str] | None = None
    ) -> None:
        self.rank = rank
        self.cuda_index = cuda_ordinal(device)
        self.device = "cpu" if self.cuda_index is None else f"cuda:{self.cuda_index}"
        self._torch_cuda = torch_cuda
        self._handle = None
        self._nvml = None
        self._warned_query = False
        if self.cuda_index is None:
            logger.info("rank %d runs on %s: no GPU memory metrics (NVML not queried)", rank, device)
            return
        environ = os.environ if environ is None else environ
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            self._handle = _device_handle(nvml, self.cuda_index, environ.get("CUDA_VISIBLE_DEVICES"))
            self._nvml = nvml
            self._index = int(nvml.nvmlDeviceGetIndex(self._handle))
            self._uuid = _text(nvml.nvmlDeviceGetUUID(self._handle))
            self._name = _text(nvml.nvmlDeviceGetName(self._handle))
        except Exception as e:  # no driver, no library, no such device: measure the rest
            self._handle = self._nvml = None
            logger.warning(
                "NVML unavailable for rank %d (%s: %s): GPU memory and utilisation metrics are off",
                rank,
                type(e).__name__,
                e,
            )

    @property
    def has_nvml(self) -> bool:
        return self._handle is not None

    def snapshot(self, kv_caches: Iterable = (), cpu_caches: Iterable = ()) -> GpuSnapshot:
        snap = GpuSnapshot(self.rank, self.device, tensor_bytes(kv_caches), tensor_bytes(cpu_caches))
        if self._handle is not None:
            self._read_nvml(snap)
        if self.cuda_index is not None:
            self._read_allocator(snap)
        return snap

    def _read_nvml(self, snap: GpuSnapshot) -> None:
        nvml, handle = self._nvml, self._handle
        snap.gpu_index, snap.gpu_uuid, snap.gpu_name = self._index, self._uuid, self._name
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            snap.memory_used_bytes, snap.memory_free_bytes = int(mem.used), int(mem.free)
            snap.memory_total_bytes = int(mem.total)
        except Exception as e:
            self._warn_query("memory", e)
        try:
            snap.utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        except Exception as e:  # e.g. NotSupported on MIG slices
            self._warn_query("utilisation", e)

    def _read_allocator(self, snap: GpuSnapshot) -> None:
        cuda = self._torch_cuda
        try:
            if cuda is None:
                import torch

                if not torch.cuda.is_initialized():  # never initialise CUDA just to measure it
                    return
                cuda = torch.cuda
            i = self.cuda_index
            snap.torch_allocated_bytes = int(cuda.memory_allocated(i))
            snap.torch_reserved_bytes = int(cuda.memory_reserved(i))
            snap.torch_peak_allocated_bytes = int(cuda.max_memory_allocated(i))
        except Exception as e:
            self._warn_query("torch allocator", e)

    def _warn_query(self, what: str, e: Exception) -> None:
        if not self._warned_query:
            self._warned_query = True
            logger.warning("rank %d: reading GPU %s failed (%s: %s); left out", self.rank, what, type(e).__name__, e)


def _device_handle(nvml, cuda_index: int, visible: str | None):
    """The NVML handle of CUDA device `cuda_index`. CUDA numbers only the visible devices
    (Ray sets CUDA_VISIBLE_DEVICES per worker), NVML numbers all of them."""
    if visible:
        entries = [v.strip() for v in visible.split(",") if v.strip()]
        entry = entries[cuda_index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(entry)  # "GPU-..." / "MIG-..."
    return nvml.nvmlDeviceGetHandleByIndex(cuda_index)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuMetrics:
    """Observable gauges over the latest snapshots of a replica's ranks (scheduler side)."""

    def __init__(self, meter_provider: MeterProvider, replica: str) -> None:
        self.replica = replica
        # replaced whole by update(), never mutated: a collecting thread sees old or new
        self._snapshots: list[tuple[GpuSnapshot, dict[str, Any]]] = []
        meter = meter_provider.get_meter(names.METER_NAME)
        gauge, updown = meter.create_observable_gauge, meter.create_observable_up_down_counter
        # (instrument factory, name, unit, description, reader(snapshot), uses the NVML labels)
        specs = (
            (updown, names.HW_GPU_MEMORY_USAGE, "By", "GPU memory used (the whole device, every process).",
             lambda s: s.memory_used_bytes),
            (updown, names.HW_GPU_MEMORY_LIMIT, "By", "Size of the GPU memory.",
             lambda s: s.memory_total_bytes),
            (gauge, names.HW_GPU_MEMORY_UTILIZATION, "1", "Fraction of GPU memory used.",
             lambda s: _ratio(s.memory_used_bytes, s.memory_total_bytes)),
            (gauge, names.HW_GPU_UTILIZATION, "1", "Fraction of time the GPU ran kernels (NVML sample period).",
             lambda s: s.utilization),
            (updown, names.GPU_MEMORY_FREE, "By", "GPU memory free (the whole device).",
             lambda s: s.memory_free_bytes),
            (updown, names.TORCH_MEMORY_ALLOCATED, "By", "Bytes held by live tensors (torch caching allocator).",
             lambda s: s.torch_allocated_bytes),
            (updown, names.TORCH_MEMORY_RESERVED, "By", "Bytes reserved by the torch caching allocator.",
             lambda s: s.torch_reserved_bytes),
            (gauge, names.TORCH_MEMORY_PEAK_ALLOCATED, "By", "Peak of torch allocated bytes since the last reset.",
             lambda s: s.torch_peak_allocated_bytes),
        )  # fmt: skip
        for factory, name, unit, description, read in specs:
            task = {names.HW_GPU_TASK: "general"} if name == names.HW_GPU_UTILIZATION else None
            factory(name, callbacks=[self._callback(read, task)], unit=unit, description=description)
        meter.create_observable_up_down_counter(
            names.KV_CACHE_MEMORY,
            callbacks=[self._observe_cache_bytes],
            unit="By",
            description="Bytes of the KV cache tensors on this rank, by pool (device: the device cache; cpu: the swap pool).",
        )

    def update(self, snapshots: Iterable[GpuSnapshot | Mapping[str, Any]]) -> None:
        """Replace the ranks' snapshots (GpuSnapshots or their dicts; None entries skipped;
        the last one of a rank wins: one observation per rank, never a sum of two)."""
        by_rank = {}
        for s in snapshots:
            if s is None:
                continue
            snap = s if isinstance(s, GpuSnapshot) else GpuSnapshot.from_dict(s)
            by_rank[snap.rank] = (snap, self._attributes(snap))
        self._snapshots = [by_rank[rank] for rank in sorted(by_rank)]

    @property
    def snapshots(self) -> list[GpuSnapshot]:
        return [s for s, _ in self._snapshots]

    def _attributes(self, snap: GpuSnapshot) -> dict[str, Any]:
        attrs: dict[str, Any] = {names.REPLICA: self.replica, names.TP_RANK: snap.rank}
        if snap.gpu_index is not None:
            attrs[names.GPU_INDEX] = snap.gpu_index
            attrs[names.HW_ID] = snap.gpu_uuid or f"gpu{snap.gpu_index}"
            if snap.gpu_name:
                attrs[names.HW_NAME] = snap.gpu_name
        return attrs

    def _callback(self, read, extra: dict[str, str] | None):
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            out = []
            for snap, attrs in self._snapshots:
                value = read(snap)
                if value is not None:
                    out.append(Observation(value, {**attrs, **extra} if extra else attrs))
            return out

        return callback

    def _observe_cache_bytes(self, options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for snap, attrs in self._snapshots:
            out.append(Observation(snap.kv_cache_bytes, {**attrs, names.POOL: names.DEVICE_POOL}))
            out.append(Observation(snap.cpu_swap_bytes, {**attrs, names.POOL: names.SWAP_POOL}))
        return out


def _ratio(used: int | None, total: int | None) -> float | None:
    if used is None or not total:
        return None
    return used / total
