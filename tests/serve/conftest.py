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
        _shut_down_handles()
        serve.shutdown()
    finally:
        ray.shutdown()
        _stop_group(head)
        shutil.rmtree(cache, ignore_errors=True)


def _shut_down_handles() -> None:
    """The routers of this process's DeploymentHandles push metrics to Serve's controller on
    a timer; stopped before Serve and Ray go, none of them logs a traceback at exit (Serve
    keeps no public way to reach a router whose handle is gone: its metrics manager it is)."""
    import gc

    from ray.serve.handle import DeploymentHandle

    from ray.serve._private.router import RouterMetricsManager

    for handle in [obj for obj in gc.get_objects() if issubclass(type(obj), DeploymentHandle)]:
        try:
            handle.shutdown()
        except Exception:  # a handle of a deleted application: nothing left to stop
            pass
    # a router outlives a handle collected before now (Serve shares routers between handles);
    # its metrics timer runs on until stopped
    for manager in [obj for obj in gc.get_objects() if type(obj) is RouterMetricsManager]:
        manager.metrics_pusher.stop_tasks()


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


def free_cpus() -> float:
    import ray

    return ray.available_resources().get("CPU", 0.0)


def live_placement_groups() -> list[dict]:
    """The cluster's placement groups that are not removed (CREATED, PENDING, RESCHEDULING)."""
    from ray.util import placement_group_table

    return [g for g in placement_group_table().values() if g["state"] != "REMOVED"]


def wait_for_free_cpus(cpus: float, timeout_s: float = 60) -> float:
    """Wait until at least `cpus` logical CPUs are free (what a test needs before its clock
    starts); the free CPUs then."""
    deadline = time.monotonic() + timeout_s
    while (free := free_cpus()) < cpus - 1e-6 and time.monotonic() < deadline:
        time.sleep(0.5)
    return free


def assert_back_to_baseline(what: str) -> None:
    """Every CPU of the session cluster free again and no placement group left, waiting for
    Serve to finish removing what was deleted; else fail naming what was left."""
    import ray

    total = ray.cluster_resources().get("CPU", 0.0)
    free = wait_for_free_cpus(total)
    groups = live_placement_groups()
    deadline = time.monotonic() + 30
    while groups and time.monotonic() < deadline:
        time.sleep(0.5)
        groups = live_placement_groups()
    if free < total - 1e-6 or groups:
        shapes = [(g["name"], g["state"], list(g["bundles"].values())) for g in groups]
        pytest.fail(f"{what} left {total - free:g} of {total:g} CPUs reserved; placement groups: {shapes}")


@pytest.fixture(autouse=True)
def _test_leaves_the_cluster_as_it_found_it(request):
    """A test that deploys through `serve_session` (its apps are deleted after it) leaves no
    replica, actor or placement group behind: a leak fails the test that made it, not a later
    one that cannot place its replicas."""
    yield
    if "serve_session" in request.fixturenames:
        assert_back_to_baseline(f"the test {request.node.name}")


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_the_cluster_as_it_found_it(request):
    """The same for a whole test file, after its module fixtures (a `serve run` shared by its
    tests) are torn down."""
    yield
    import ray

    if ray.is_initialized():
        assert_back_to_baseline(f"the tests of {request.node.name}")


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
