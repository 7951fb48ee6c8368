"""The loader's load-time / peak-memory line (INFO) reaches the log of the Ray actor that
loads the model, at the default level: an actor process's root logger has no handler, so
without show_info_logs Python prints WARNING and up only. Run in a fresh interpreter, as an
actor process starts."""

from __future__ import annotations

import subprocess
import sys

from rayserve_paged.deployments.llm_server import ReplicaSchedulerActor
from rayserve_paged.engine.scheduler_actor import SchedulerActor

SCRIPT = """
import logging
from pathlib import Path
import torch
from rayserve_paged.models.loader import _log_load
_log_load(Path("before"), torch.float32, torch.device("cpu"), 1.25)  # dropped: no handler for INFO
{setup}
_log_load(Path("tiny-opt"), torch.float32, torch.device("cpu"), 1.25)
logging.getLogger("rayserve_paged.engine").debug("debug stays hidden")
"""


def _stderr(setup: str) -> str:
    code = SCRIPT.format(setup=setup)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stderr


def test_the_load_line_reaches_an_actors_log_once():
    setup = "from rayserve_paged.engine.ray_executor import show_info_logs\nshow_info_logs()\nshow_info_logs()"
    stderr = _stderr(setup)
    lines = [line for line in stderr.splitlines() if "loaded" in line]
    assert len(lines) == 1, lines  # the line before the setup is dropped; after it, once however often set up
    assert lines[0].startswith("INFO ")
    assert "rayserve_paged.models.loader -- loaded tiny-opt as torch.float32 on cpu in 1.2 s (peak RSS" in lines[0]
    assert lines[0].endswith("GiB)") and "debug stays hidden" not in stderr


def test_an_operators_logging_config_is_left_alone():
    setup = (
        "logging.basicConfig(level=logging.WARNING, format='ROOT %(message)s')\n"
        "from rayserve_paged.engine.ray_executor import show_info_logs\nshow_info_logs()"
    )
    assert "loaded" not in _stderr(setup)  # the root logger's level and handler decide


def test_the_replica_starts_its_scheduler_actor_with_the_logs_shown():
    assert issubclass(ReplicaSchedulerActor, SchedulerActor)
    assert ReplicaSchedulerActor.__name__.endswith("SchedulerActor")  # what `ray list actors` shows
