"""Session-wide test settings."""

from __future__ import annotations

import os

# Tests run on a 2-core machine that other processes share: one intra-op thread per test
# process avoids torch's threads spinning against each other (several times slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The test process connects to Ray only through the session fixture's explicit ray.init. A
# call that reaches Ray after the fixture's ray.shutdown (a Serve handle's router thread
# retrying its long poll) must fail, not auto-connect to the cluster being stopped: a driver
# connected that way outlives the GCS and Ray ends the process with exit 1 after 60 s.
# (Read once, when ray is first imported.)
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from hypothesis import settings

# CI replays the same examples every run (a red CI must be reproducible); local runs explore.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the core tests need no torch
    pass


def pytest_configure(config):
    # here, not in pyproject's filterwarnings: where pydantic does not import (the GPU image)
    # pytest releases before the fix of pytest-dev/pytest#13732 refuse to start on such a filter
    try:
        import pydantic.warnings  # noqa: F401
    except ImportError:
        return
    config.addinivalue_line("filterwarnings", "ignore::pydantic.warnings.PydanticDeprecatedSince20")


# The serving tests share one Ray cluster (tests/serve/conftest.py) and so one test process.
SERVE_TESTS = "tests/serve/"


def _work_unit(nodeid: str) -> str:
    """What one test process runs whole: tests/serve together, any other file by itself (so
    a module fixture is made once)."""
    return SERVE_TESTS if nodeid.startswith(SERVE_TESTS) else nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: `make test` runs two test processes
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return ByWorkUnit(config, log)


def _unique_node_ids(items) -> None:
    """schemathesis names each operation's item `test[POST /v1/completions]`, but under pytest
    9.2 the items of one test share the test's node id; xdist keys its work by node id and would
    run one operation of each such test. Such items get their own names back in their ids."""
    seen: dict[str, int] = {}
    for item in items:
        seen[item.nodeid] = seen.get(item.nodeid, 0) + 1
    for item in items:
        if seen[item.nodeid] > 1 and item.parent is not None and not item.nodeid.endswith(item.name):
            if hasattr(item, "_id"):  # pytest >= 9.2: a structured id
                item._id = item.parent.id.child(item.name)
            else:
                item._nodeid = f"{item.parent.nodeid}::{item.name}"
    shared = sorted({item.nodeid for item in items if seen.get(item.nodeid, 0) > 1})
    if len({item.nodeid for item in items}) != len(items):
        raise pytest.UsageError(f"tests share node ids (the test processes would run one of each): {shared}")


def pytest_collection_modifyitems(config, items):
    """The order of the tests: tests/serve first, as the longest work unit (with two test
    processes the other takes every other file beside it), then the files in their order.

    RAYSERVE_PAGED_TEST_ORDER=<seed>: the files in a shuffled order and each file's tests
    shuffled too (tests/serve stays first, its files and tests shuffled among themselves),
    to show the suite does not depend on its order. Unset: the files' own order."""
    _unique_node_ids(items)
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    groups = list(modules.values())
    seed = os.environ.get("RAYSERVE_PAGED_TEST_ORDER")
    if seed is not None:
        import random

        rng = random.Random(int(seed))
        rng.shuffle(groups)
        for group in groups:
            rng.shuffle(group)
    groups.sort(key=lambda group: _work_unit(group[0].nodeid) != SERVE_TESTS)  # stable: serve first
    items[:] = [item for group in groups for item in group]
