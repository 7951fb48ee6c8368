"""The CPU worker's torch thread count comes from its CPU allocation, most specific first."""

from __future__ import annotations

import os

import pytest

from rayserve_paged.worker.worker import cpu_thread_count


def test_configured_threads_win(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_thread_count(5) == (5, "num_cpu_threads")


def test_omp_num_threads_as_ray_sets_it_for_an_actor(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_thread_count(None) == (3, "OMP_NUM_THREADS")


@pytest.mark.parametrize("value", ["", "0", "two"])
def test_else_the_cpus_the_process_may_run_on(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert cpu_thread_count(None) == (3, "CPU affinity")
