"""The worker's start-up duties for the GPU path, on CPU: the KV sizing reserves the
attention backend's decode workspace, and every kernel variant is warmed up once the cache
exists (so nothing compiles after the engine reports ready)."""

from __future__ import annotations

import torch

from rayserve_paged.config import EngineConfig
from rayserve_paged.models.tiny import resolve_model
from rayserve_paged.ops.paged_attention import TorchReferenceBackend
from rayserve_paged.worker import worker as worker_module
from rayserve_paged.worker.kv_sizing import kv_cache_budget_bytes
from rayserve_paged.worker.worker import Worker

GiB = 1 << 30


def test_kv_budget_subtracts_other_processes_the_profile_peak_and_the_decode_workspace():
    # 80 GiB device, 10 GiB held by another process, 2 GiB allocated by us, peak 6 GiB, 90%
    budget = kv_cache_budget_bytes(80 * GiB, 68 * GiB, 2 * GiB, 6 * GiB, 0.9, workspace=GiB)
    assert budget == int(80 * GiB * 0.9) - 10 * GiB - 6 * GiB - GiB
    assert kv_cache_budget_bytes(80 * GiB, 68 * GiB, 2 * GiB, 6 * GiB, 0.9, workspace=0) == budget + GiB


class RecordingBackend(TorchReferenceBackend):
    """The torch reference, recording what the worker asks of a compiling backend."""

    def __init__(self) -> None:
        self.calls: list = []

    def warm_up(self, key_cache, value_cache, num_heads, query_token_stride=None):
        self.calls.append(("warm_up", key_cache, value_cache, num_heads, query_token_stride))
        return ["variant a", "variant b"]

    def decode_workspace_bytes(self, max_num_seqs, num_heads, num_kv_heads, head_dim, max_seq_len, device):
        self.calls.append(("workspace", max_num_seqs, num_heads, num_kv_heads, head_dim, max_seq_len))
        return 12345


def test_worker_warms_up_the_backend_on_the_allocated_cache_and_sizes_its_workspace(monkeypatch):
    backend = RecordingBackend()
    monkeypatch.setattr(worker_module, "get_attention_backend", lambda name, device: backend)
    config = EngineConfig(model="tiny-opt", device="cpu", max_num_seqs=7, max_model_len=200, num_cpu_threads=1)
    worker = Worker(config, str(resolve_model("tiny-opt")))
    worker.load_model()
    worker.init_cache(5, 0)
    mc = worker.model_config
    (name, key_cache, value_cache, num_heads, stride), = [c for c in backend.calls if c[0] == "warm_up"]
    assert key_cache is worker.kv_caches[0][0] and value_cache is worker.kv_caches[0][1]
    assert num_heads == mc.num_heads and stride == (mc.num_heads + 2 * worker.num_kv_heads) * mc.head_dim
    assert worker.warmed_up == ["variant a", "variant b"]
    assert worker.decode_workspace_bytes() == 12345
    assert backend.calls[-1] == ("workspace", 7, mc.num_heads, worker.num_kv_heads, mc.head_dim, 200)


def test_the_torch_backend_has_nothing_to_warm_up():
    cache = torch.zeros(2, 16, 2, 8)
    assert TorchReferenceBackend().warm_up(cache, cache, 4) == []
    assert TorchReferenceBackend().decode_workspace_bytes(8, 4, 2, 8, 100, "cpu") == 0
