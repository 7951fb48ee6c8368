"""One Ray cluster for the whole serving test session (2 CPUs, no dashboard), shared by the
test process and the `serve run` subprocess."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """Address of a local head node started for this session; stopped at the end.

    `ray start --block` keeps the head's processes tied to one process group, so the end of
    the session stops exactly this cluster (`ray stop` would stop every Ray on the machine).
    """
    os.environ.update(RAY_ENV)
    cache = tmp_path_factory.mktemp("model-cache")
    os.environ["RAYSERVE_PAGED_CACHE"] = str(cache)  # tiny models made once, shared by processes
    port = _free_port()
    head = subprocess.Popen(
        [_ray_bin(), "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
         "--include-dashboard=false", "--disable-usage-stats"],
        env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    import ray

    _connect(ray, address, head)
    yield address
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        _stop_group(head)
        shutil.rmtree(cache, ignore_errors=True)


def _stop_group(head: subprocess.Popen) -> None:
    """SIGTERM the head's process group, then SIGKILL whatever of it is left (`ray start
    --block` has been seen to outlive a SIGTERM by more than 30 s; nothing of a test
    cluster needs keeping)."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            return
        try:
            head.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(1)


def _connect(ray, address: str, head: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}")
        try:
            ray.init(address=address)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@pytest.fixture(scope="session")
def serve_port() -> int:
    """The HTTP port of Serve's proxy on the session cluster (loopback only)."""
    return _free_port()


@pytest.fixture()
def serve_session(ray_cluster, serve_port):
    """Serve on the session cluster; every app is deleted after the test."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
    yield serve
    for name in list(serve.status().applications):
        serve.delete(name)
