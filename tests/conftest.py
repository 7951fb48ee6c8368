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


def pytest_collection_modifyitems(config, items):
    """RAYSERVE_PAGED_TEST_ORDER=<seed>: run the test files in a shuffled order and each
    file's tests shuffled too (module fixtures are still made once per file), to show the
    suite does not depend on its order. Unset: the files' own order."""
    seed = os.environ.get("RAYSERVE_PAGED_TEST_ORDER")
    if seed is None:
        return
    import random

    rng = random.Random(int(seed))
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    groups = list(modules.values())
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    items[:] = [item for group in groups for item in group]
