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


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook turns the groups into node ids
def pytest_collection_modifyitems(config, items):
    """Order and groups for the test processes of `make test` (pytest-xdist, --dist loadgroup).

    Each file is one group, so a module fixture is made once; tests/serve is one group, the
    longest, and goes first so that the other process takes every other file beside it.

    RAYSERVE_PAGED_TEST_ORDER=<seed>: the files in a shuffled order and each file's tests
    shuffled too (the serving tests stay together, shuffled among themselves), to show the
    suite does not depend on its order. Unset: the files' own order."""
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
    groups.sort(key=lambda group: not group[0].nodeid.startswith(SERVE_TESTS))  # stable: serve first
    for group in groups:
        path = group[0].nodeid.split("::", 1)[0]
        name = "serve" if path.startswith(SERVE_TESTS) else path
        for item in group:
            item.add_marker(pytest.mark.xdist_group(name))
    items[:] = [item for group in groups for item in group]
