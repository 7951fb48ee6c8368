"""The loader's load-time / peak-memory line (INFO) reaches the log of the Ray actor that
loads the model, at the default level: an actor process's root logger has no handler, so
without show_info_logs Python prints WARNING and up only. The tests give the root logger
no handler, as in an actor process, and put the logging state back afterwards."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from rayserve_paged.deployments.llm_server import ReplicaSchedulerActor
from rayserve_paged.engine.ray_executor import show_info_logs
from rayserve_paged.engine.scheduler_actor import SchedulerActor
from rayserve_paged.models.loader import _log_load


@pytest.fixture
def actor_process_logging(monkeypatch):
    """as_actor(): the root logger as in a fresh Ray actor process (no handler, level
    WARNING); called in the test's body, since pytest adds its capture handler to the root
    logger at the start of each phase. The package logger is put back afterwards."""
    root, package = logging.getLogger(), logging.getLogger("rayserve_paged")
    handlers, level = list(package.handlers), package.level

    def as_actor() -> None:
        monkeypatch.setattr(root, "handlers", [])
        monkeypatch.setattr(root, "level", logging.WARNING)

    yield as_actor
    package.handlers[:] = handlers
    package.setLevel(level)


def _load_line() -> None:
    _log_load(Path("tiny-opt"), torch.float32, torch.device("cpu"), 1.25, "float weights")


def test_the_load_line_reaches_an_actors_log_once(actor_process_logging, capsys):
    actor_process_logging()
    _load_line()  # before: INFO has no handler to go to (Python's last resort prints WARNING+)
    assert "loaded" not in capsys.readouterr().err
    show_info_logs()
    show_info_logs()
    _load_line()
    logging.getLogger("rayserve_paged.engine").debug("debug stays hidden")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines  # once, however often it is set up
    assert lines[0].startswith("INFO ")
    assert "rayserve_paged.models.loader -- loaded tiny-opt as torch.float32 on cpu in 1.2 s (float weights; peak RSS" in lines[0]
    assert lines[0].endswith("GiB)")


def test_an_operators_logging_config_is_left_alone(actor_process_logging, capsys):
    actor_process_logging()
    root = logging.getLogger()
    handler = logging.StreamHandler()
    root.handlers.append(handler)  # the operator configured logging in this process
    show_info_logs()
    assert not any(getattr(h, "is_rayserve_paged", False) for h in logging.getLogger("rayserve_paged").handlers)
    _load_line()
    assert "loaded" not in capsys.readouterr().err  # the root logger's WARNING level decides


def test_the_replica_starts_its_scheduler_actor_with_the_logs_shown():
    assert issubclass(ReplicaSchedulerActor, SchedulerActor)
    assert ReplicaSchedulerActor.__name__.endswith("SchedulerActor")  # what `ray list actors` shows
