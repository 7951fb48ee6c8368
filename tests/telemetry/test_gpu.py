"""GPU figures: NVML absent, NVML faked through the probe's seam, and the scheduler side."""

from __future__ import annotations

import logging
import pickle
from types import SimpleNamespace

import pytest
import torch
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from rayserve_paged.telemetry import GpuMetrics, GpuProbe, GpuSnapshot, TelemetryConfig, setup_meter_provider
from rayserve_paged.telemetry import names, tensor_bytes
from rayserve_paged.telemetry.gpu import cuda_ordinal

from .readings import Readings

GiB = 1 << 30


class NVMLError(Exception):
    pass


class FakeNvml:
    """pynvml's function names over a table of devices, by NVML index."""

    def __init__(self, devices: dict[int, dict], fail_init: Exception | None = None):
        self.devices = devices
        self.fail_init = fail_init
        self.calls: list[str] = []

    def nvmlInit(self):
        self.calls.append("init")
        if self.fail_init is not None:
            raise self.fail_init

    def nvmlDeviceGetHandleByIndex(self, index):
        self.calls.append(f"by_index:{index}")
        if index not in self.devices:
            raise NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.calls.append(f"by_uuid:{uuid}")
        return next(i for i, d in self.devices.items() if d["uuid"] == uuid)

    def nvmlDeviceGetIndex(self, handle):
        return handle

    def nvmlDeviceGetUUID(self, handle):
        return self.devices[handle]["uuid"]

    def nvmlDeviceGetName(self, handle):
        return self.devices[handle]["name"].encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, handle):
        d = self.devices[handle]
        return SimpleNamespace(total=d["total"], used=d["used"], free=d["total"] - d["used"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        util = self.devices[handle]["util"]
        if util is None:
            raise NVMLError("Not Supported")  # MIG slices
        return SimpleNamespace(gpu=util, memory=0)


class FakeCuda:
    def __init__(self, allocated, reserved, peak):
        self.figures = (allocated, reserved, peak)
        self.indices: list[int] = []

    def memory_allocated(self, i):
        self.indices.append(i)
        return self.figures[0]

    def memory_reserved(self, i):
        return self.figures[1]

    def max_memory_allocated(self, i):
        return self.figures[2]


def device(uuid, used_gib, util, total_gib=80, name="NVIDIA H100 80GB HBM3"):
    return dict(uuid=uuid, name=name, total=total_gib * GiB, used=used_gib * GiB, util=util)


def telemetry_records(caplog):
    return [r for r in caplog.records if r.name.startswith("rayserve_paged.telemetry")]


@pytest.fixture
def metrics():
    reader = InMemoryMetricReader()
    provider = setup_meter_provider(TelemetryConfig(), [reader])
    return GpuMetrics(provider, "rep-7"), reader


# ---------------------------------------------------------------------- NVML absent


def test_nvml_absent_starts_measures_the_rest_and_logs_once(caplog, metrics):
    caplog.set_level(logging.DEBUG)
    nvml = FakeNvml({}, fail_init=NVMLError("NVML Shared Library Not Found"))
    probe = GpuProbe(0, "cuda:0", nvml=nvml)
    kv = [(torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8))]  # [num_blocks, block_size, heads, head_dim]
    snaps = [probe.snapshot(kv, kv[:0]) for _ in range(3)]
    gpu, reader = metrics
    gpu.update(snaps)  # one rank three times: the last wins

    assert not probe.has_nvml
    assert snaps[0].memory_total_bytes is None and snaps[0].utilization is None and snaps[0].gpu_index is None
    r = Readings.collect(reader)
    assert not set(names.NVML_INSTRUMENTS) & r.metrics.keys()
    assert r.value(names.KV_CACHE_MEMORY, pool="device", tp_rank=0) == 2 * 4 * 16 * 2 * 8 * 4
    assert r.value(names.KV_CACHE_MEMORY, pool="cpu", tp_rank=0) == 0
    records = telemetry_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "NVML unavailable" in records[0].getMessage() and "Library Not Found" in records[0].getMessage()


def test_the_real_pynvml_never_raises(caplog):
    caplog.set_level(logging.INFO)
    probe = GpuProbe(0, "cuda:0")  # here: no driver, so NVMLError at nvmlInit
    snap = probe.snapshot()
    if probe.has_nvml:  # a machine with a GPU
        assert snap.memory_total_bytes > 0
    else:
        assert snap.memory_total_bytes is None
        assert [r.levelno for r in telemetry_records(caplog)] == [logging.WARNING]


def test_a_cpu_worker_does_not_query_nvml(caplog):
    caplog.set_level(logging.INFO)
    nvml = FakeNvml({0: device("GPU-a", 1, 50)})
    probe = GpuProbe(2, torch.device("cpu"), nvml=nvml)
    snap = probe.snapshot()
    assert nvml.calls == [] and snap.device == "cpu" and snap.rank == 2
    assert snap.gpu_index is None and snap.torch_allocated_bytes is None
    assert len(telemetry_records(caplog)) == 1


# ---------------------------------------------------------------------- NVML faked


def test_faked_nvml_values_and_labels(metrics):
    nvml = FakeNvml({0: device("GPU-aaa", 10, 40), 1: device("GPU-bbb", 20, 90)})
    cuda = FakeCuda(allocated=5 * GiB, reserved=6 * GiB, peak=7 * GiB)
    ranks = [GpuProbe(r, f"cuda:{r}", nvml=nvml, torch_cuda=cuda, environ={}) for r in (0, 1)]
    gpu, reader = metrics
    gpu.update([p.snapshot().to_dict() for p in ranks])  # dicts, as they cross Ray

    r = Readings.collect(reader)
    labels = {
        names.REPLICA: "rep-7",
        names.TP_RANK: 1,
        names.GPU_INDEX: 1,
        names.HW_ID: "GPU-bbb",
        names.HW_NAME: "NVIDIA H100 80GB HBM3",
    }
    assert r.point(names.HW_GPU_MEMORY_USAGE, tp_rank=1).attributes == labels
    assert r.value(names.HW_GPU_MEMORY_USAGE, tp_rank=1) == 20 * GiB
    assert r.value(names.HW_GPU_MEMORY_LIMIT, tp_rank=1) == 80 * GiB
    assert r.value(names.GPU_MEMORY_FREE, tp_rank=1) == 60 * GiB
    assert r.value(names.HW_GPU_MEMORY_UTILIZATION, tp_rank=1) == pytest.approx(0.25)
    assert r.point(names.HW_GPU_UTILIZATION, tp_rank=1).attributes == {**labels, names.HW_GPU_TASK: "general"}
    assert r.value(names.HW_GPU_UTILIZATION, tp_rank=1) == pytest.approx(0.9)
    assert r.value(names.HW_GPU_UTILIZATION, tp_rank=0, gpu_index=0, **{names.HW_ID: "GPU-aaa"}) == pytest.approx(0.4)
    assert r.value(names.TORCH_MEMORY_ALLOCATED, tp_rank=0) == 5 * GiB
    assert r.value(names.TORCH_MEMORY_RESERVED, tp_rank=0) == 6 * GiB
    assert r.value(names.TORCH_MEMORY_PEAK_ALLOCATED, tp_rank=0) == 7 * GiB
    assert cuda.indices == [0, 1]
    # semconv: hw.gpu.memory.usage is an up-down counter, hw.gpu.utilization a gauge
    assert r.kinds[names.HW_GPU_MEMORY_USAGE] == "sum" and not r.monotonic[names.HW_GPU_MEMORY_USAGE]
    assert r.kinds[names.HW_GPU_UTILIZATION] == "gauge"

    gpu.update([ranks[0].snapshot()])  # the latest snapshots replace the old ones
    assert {p.attributes[names.TP_RANK] for p in Readings.collect(reader).points(names.HW_GPU_MEMORY_USAGE)} == {0}


def test_cuda_visible_devices_maps_the_cuda_ordinal_to_the_nvml_device():
    nvml = FakeNvml({i: device(f"GPU-{i}", i, 10) for i in range(8)})
    by_index = GpuProbe(0, "cuda:1", nvml=nvml, torch_cuda=FakeCuda(0, 0, 0), environ={"CUDA_VISIBLE_DEVICES": "6,3"})
    assert by_index.snapshot().gpu_index == 3 and "by_index:3" in nvml.calls
    by_uuid = GpuProbe(0, "cuda:0", nvml=nvml, torch_cuda=FakeCuda(0, 0, 0), environ={"CUDA_VISIBLE_DEVICES": "GPU-5"})
    snap = by_uuid.snapshot()
    assert (snap.gpu_index, snap.gpu_uuid, snap.memory_used_bytes) == (5, "GPU-5", 5 * GiB)


def test_utilisation_not_supported_leaves_only_it_out(caplog, metrics):
    caplog.set_level(logging.INFO)
    nvml = FakeNvml({0: device("MIG-x", 3, None)})
    probe = GpuProbe(0, "cuda:0", nvml=nvml, torch_cuda=FakeCuda(1, 2, 3), environ={})
    snaps = [probe.snapshot(), probe.snapshot()]
    gpu, reader = metrics
    gpu.update(snaps)
    r = Readings.collect(reader)
    assert names.HW_GPU_UTILIZATION not in r.metrics
    assert r.value(names.HW_GPU_MEMORY_USAGE) == 3 * GiB
    assert len(telemetry_records(caplog)) == 1  # one warning, not one per snapshot


def test_snapshot_is_plain_picklable_data():
    snap = GpuSnapshot(1, "cuda:0", 10, 20, gpu_index=2, gpu_uuid="GPU-2", memory_used_bytes=5, utilization=0.5)
    assert pickle.loads(pickle.dumps(snap)) == snap
    d = snap.to_dict()
    assert all(isinstance(v, (int, float, str, type(None))) for v in d.values())
    assert GpuSnapshot.from_dict({**d, "added_later": 1}) == snap  # unknown keys are dropped


def test_helpers():
    assert [cuda_ordinal(d) for d in ("cuda:2", "cuda", "cpu", 3, None)] == [2, 0, None, 3, None]
    assert cuda_ordinal(torch.device("cuda", 1)) == 1 and cuda_ordinal(torch.device("cpu")) is None
    pairs = [(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16))]
    assert tensor_bytes(pairs) == 6 * 4 + 6 * 2 and tensor_bytes([]) == 0


def test_without_nvml_the_replica_metrics_still_flow(swap_run):
    worker = swap_run.engine.executor.worker
    probe = GpuProbe(0, "cuda:0", nvml=FakeNvml({}, fail_init=NVMLError("Driver Not Loaded")))
    try:
        swap_run.telemetry.update_gpu([probe.snapshot(worker.kv_caches, worker.cpu_caches).to_dict()])
        text = swap_run.telemetry.metrics_text()
    finally:
        swap_run.telemetry.update_gpu([])
    assert "hw_gpu" not in text and "rayserve_paged_gpu_memory" not in text
    kv_bytes = float(tensor_bytes(worker.kv_caches))
    assert f'rayserve_paged_kv_cache_memory_bytes{{pool="device",replica="replica-a",tp_rank="0"}} {kv_bytes}' in text
    assert "rayserve_paged_scheduler_preemptions_total" in text
