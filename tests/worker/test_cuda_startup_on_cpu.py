"""The worker's start-up on its GPU branches, run on CPU: `torch.cuda` patched to report
one device (two for the TP test), tensors that ask for a CUDA device placed on the CPU.

Every patched torch.cuda call checks its device argument the way torch does (an
unindexed torch.device("cuda") raises ValueError, as torch.cuda.set_device does), so a
call site that passes an unindexed device fails here, in CI, not at a GPU's first start.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.outputs import NewRequest, StepMessage
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.models.tiny import resolve_model
from rayserve_paged.ops.paged_attention import TorchReferenceBackend
from rayserve_paged.worker import worker as worker_module
from rayserve_paged.worker.kv_sizing import kv_cache_budget_bytes
from rayserve_paged.worker.worker import Worker, resolve_device

MiB = 1 << 20


def _is_cuda(device) -> bool:
    return device is not None and not isinstance(device, int) and torch.device(device).type == "cuda"


class CudaOnCpu(TorchFunctionMode):
    """Tensors asked for on a CUDA device are made on the CPU (pinned memory too); every
    such device is recorded, so a test can assert that each one carried its index."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[torch.device] = []

    def _place(self, device):
        if _is_cuda(device):
            self.devices.append(torch.device(device))
            return "cpu"
        return device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = self._place(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name == "to":
            args = tuple(self._place(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if name == "pin_memory":
            return args[0]
        return func(*args, **kwargs)


class FakeCuda:
    """torch.cuda as one (or `count`) device(s) with `total` bytes, of which `held` are
    allocated by this process after start-up steps; records (function, device) calls."""

    def __init__(self, count: int = 1, total: int = 64 * MiB, free: int = 60 * MiB) -> None:
        self.count, self.total, self.free = count, total, free
        self.calls: list[tuple[str, object]] = []
        self.captures: list[dict] = []
        self.allocated = 0
        self.peak = 3 * MiB

    def indexed(self, name: str, device) -> int:
        """The ordinal, as torch.cuda resolves it; ValueError for an unindexed CUDA device."""
        self.calls.append((name, device))
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            if device.type != "cuda" or device.index is None:
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
            index = device.index
        assert 0 <= index < self.count, f"{name}: device {index} of {self.count}"
        return index

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        fake = self

        class Stream:
            def __init__(self, device=None):
                fake.indexed("Stream", device)

            def wait_stream(self, other):
                pass

            def wait_event(self, event):
                pass

        class Event:
            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

        class CUDAGraph:
            def replay(self):
                raise AssertionError("no replay in a start-up test")

        @contextlib.contextmanager
        def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            fake.captures.append({"pool": pool, "capture_error_mode": capture_error_mode})
            yield

        patches = {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "current_device": lambda: 0,
            "is_initialized": lambda: True,
            "set_device": lambda device: self.indexed("set_device", device),
            "mem_get_info": lambda device: (self.indexed("mem_get_info", device), (self.free, self.total))[1],
            "empty_cache": lambda: self.calls.append(("empty_cache", None)),
            "reset_peak_memory_stats": lambda device: self.indexed("reset_peak_memory_stats", device),
            "synchronize": lambda device: self.indexed("synchronize", device),
            "max_memory_allocated": lambda device: (self.indexed("max_memory_allocated", device), self.peak)[1],
            "memory_allocated": lambda device: (self.indexed("memory_allocated", device), self.allocated)[1],
            "memory_reserved": lambda device: (self.indexed("memory_reserved", device), self.allocated)[1],
            "current_stream": lambda device: (self.indexed("current_stream", device), Stream(device))[1],
            "stream": lambda stream: contextlib.nullcontext(),
            "Stream": Stream,
            "Event": Event,
            "CUDAGraph": CUDAGraph,
            "graph": graph,
            "graph_pool_handle": lambda: "pool",
        }
        for name, value in patches.items():
            monkeypatch.setattr(cuda, name, value)

    def called(self, name: str) -> list:
        return [device for called, device in self.calls if called == name]


class CapturableReference(TorchReferenceBackend):
    """The torch reference claiming capturability, so that the worker captures graphs."""

    supports_cuda_graphs = True


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    backends = []

    def backend_for(name, device):
        fake.indexed("get_attention_backend", device)
        backends.append(CapturableReference())
        return backends[-1]

    monkeypatch.setattr(worker_module, "get_attention_backend", backend_for)
    with CudaOnCpu() as placement:
        fake.placement = placement
        yield fake


def _config(**options) -> EngineConfig:
    return EngineConfig(
        model="tiny-opt", device="auto", max_num_seqs=4, max_model_len=64, swap_space_gb=0.001,
        num_cpu_threads=1, **options,
    )


def test_resolve_device_gives_an_indexed_cuda_device(monkeypatch):
    fake = FakeCuda(count=2)
    fake.install(monkeypatch)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda", rank=1) == torch.device("cuda", 1)
    assert resolve_device("cuda", rank=3) == torch.device("cuda", 1)  # rank modulo the visible devices
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        resolve_device("cuda")


def test_the_unpatched_set_device_rejects_an_unindexed_device():
    """The error this file guards against, as torch raises it (on any build)."""
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))


def test_worker_start_up_on_the_gpu_branches(fake_cuda):
    worker = Worker(_config(), str(resolve_model("tiny-opt")))
    assert worker.device == torch.device("cuda", 0) and worker.gpu_probe.device == "cuda:0"
    worker.load_model()
    assert fake_cuda.called("set_device") == [torch.device("cuda", 0)]
    assert worker.runner.static_decode.capture_error_mode == "global"
    sizes = worker.determine_num_blocks()
    # the profile ran on the GPU branch, and none of its caches outlives it
    assert fake_cuda.called("mem_get_info") == [torch.device("cuda", 0)]
    assert worker.kv_caches == [] and worker.cpu_caches == [] and worker.swapper.device_tensors == []
    static = worker.runner.static_decode
    row_bytes = worker.model_config.hidden_size * torch.tensor([], dtype=worker.dtype).element_size()
    graphs = fake_cuda.peak + row_bytes * sum(static.buckets)  # profile_bytes with the fake allocator figures
    budget = kv_cache_budget_bytes(
        fake_cuda.total, fake_cuda.free, 0, fake_cuda.peak, worker.config.gpu_memory_utilization,
        worker.decode_workspace_bytes(), cuda_graph_bytes=graphs,
    )
    assert sizes.num_gpu_blocks == budget // worker.block_bytes() > 0
    worker.init_cache(sizes.num_gpu_blocks, sizes.num_cpu_blocks)
    assert worker.kv_caches[0][0].shape[0] == sizes.num_gpu_blocks
    # one capture per bucket, largest first, in one pool, in the process-wide error mode
    assert worker.cuda_graphs == list(static.buckets) == [1, 2, 4]
    assert fake_cuda.captures == [{"pool": "pool", "capture_error_mode": "global"}] * 3
    assert worker.swapper.stream is None  # the caches live on the CPU here: no side stream
    # a prefill, then a decode step on the padded path (the fake capture holds nothing to
    # replay): the host mirror's one copy per step, ordered by an event on the rank's stream
    static.graphs = {}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = worker.execute(StepMessage(
        new_requests=[NewRequest("a", 0, params, 3)], block_table_updates=[(0, 0, [1])], seq_ids=[0],
        start_positions=[0], num_query_tokens=[3], token_ids=[5, 6, 7], first_step_seq_ids=[0],
    ))
    worker.execute(StepMessage(seq_ids=[0], start_positions=[3], num_query_tokens=[1],
                               token_ids=[first.samples[0].token_ids[0]]))
    assert worker.runner.last_path == "static-eager" and static.num_copies == 1
    # the eager steps (the profile step, the prefill): their inputs in one pinned buffer, one
    # copy each, ordered by an event on the rank's stream too
    assert worker.runner.staging.is_copied and worker.runner.staging.num_copies == 2
    assert fake_cuda.called("current_stream") == [torch.device("cuda", 0)] * 3
    # every tensor that asked for a CUDA device named its index
    assert fake_cuda.placement.devices and set(fake_cuda.placement.devices) == {torch.device("cuda", 0)}
    for name, device in fake_cuda.calls:
        assert device is None or name == "Stream" or torch.device(device).index == 0, (name, device)


def test_profile_out_of_memory_names_max_model_len(fake_cuda, monkeypatch):
    config = EngineConfig(model="tiny-opt", device="auto", max_num_seqs=4, num_cpu_threads=1)
    worker = Worker(config, str(resolve_model("tiny-opt")))
    worker.load_model()

    def out_of_memory():
        worker._allocate_caches(2, 0)  # what the profile had allocated when it failed
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(worker, "_profile_run", out_of_memory)
    model_len = worker.model_config.max_model_len
    with pytest.raises(RuntimeError, match=f"max_model_len is not set, so the model's own {model_len}"):
        worker.determine_num_blocks()
    assert worker.kv_caches == [] and worker.swapper.device_tensors == []


def test_enforce_eager_releases_the_profile_caches(fake_cuda):
    worker = Worker(_config(enforce_eager=True), str(resolve_model("tiny-opt")))
    worker.load_model()
    assert worker.runner.static_decode is None
    worker.determine_num_blocks()
    assert worker.kv_caches == [] and worker.swapper.device_tensors == [] and worker.swapper.host_tensors == []
    assert ("empty_cache", None) in fake_cuda.calls


def test_tensor_parallel_rank_warms_up_a_collective_before_the_kv_sizing(fake_cuda, monkeypatch):
    fake_cuda.count = 2
    order: list[str] = []

    def all_reduce(tensor, group=None):
        order.append("all_reduce")
        tensor.mul_(2)  # two ranks holding the same value

    def all_gather(parts, tensor, group=None):
        for part in parts:
            part.copy_(tensor)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    real_mem_get_info = torch.cuda.mem_get_info
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (order.append("mem_get_info"), real_mem_get_info(device))[1])
    worker = Worker(_config(), str(resolve_model("tiny-opt")), rank=1, world_size=2)
    assert worker.device == torch.device("cuda", 1)
    worker.load_model(group="tp-group")
    assert order == ["all_reduce"]  # the warm-up, before anything is measured
    assert fake_cuda.called("set_device") == [torch.device("cuda", 1)]
    assert worker.runner.static_decode.capture_error_mode == "thread_local"
    worker.determine_num_blocks()
    assert order.index("mem_get_info") == 1
    worker.init_cache(4, 0)
    assert {c["capture_error_mode"] for c in fake_cuda.captures} == {"thread_local"}


def test_static_decode_indexes_an_unindexed_cuda_device(fake_cuda, monkeypatch):
    from rayserve_paged.worker.static_decode import StaticDecode

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    static = StaticDecode(torch.nn.Identity(), 16, 2, 64, "cuda", CapturableReference())
    assert static.device == torch.device("cuda", 0) and static.can_capture
