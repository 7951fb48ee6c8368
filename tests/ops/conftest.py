"""What every kernel test shares: one intra-op thread, and a generator seeded per test."""

from __future__ import annotations

import zlib

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "quick: the few triton tests that `benchmarks/gpu_check.py --quick` runs (one per kernel path)"
    )


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add spin-waiting on a shared 2-core machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture
def generator(request) -> torch.Generator:
    """A fresh generator per test, seeded from the test id (different for every parameter set)."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
