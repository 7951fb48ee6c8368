"""CPU KV pools are zero pages mapped on first touch: resident memory follows the blocks
written, not the pool's size."""

from __future__ import annotations

import re

import torch

from rayserve_paged.worker.worker import host_zeros


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def test_host_zeros_are_zero_writable_and_resident_only_where_written():
    before = _rss_kib()
    pool = host_zeros((256, 16, 4, 64), torch.float32)  # 64 MiB: [blocks, block_size, kv_heads, head_dim]
    assert pool.shape == (256, 16, 4, 64) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert _rss_kib() - before < 8 * 1024  # nothing touched yet
    pool[:4] = 1.0  # four blocks, 64 KiB each
    assert _rss_kib() - before < 8 * 1024
    assert pool[:4].eq(1).all() and pool[4:].eq(0).all()  # reading maps the zero page: still exact zeros
    assert host_zeros((0, 16, 4, 64), torch.bfloat16).shape == (0, 16, 4, 64)
