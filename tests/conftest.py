"""Session-wide test settings."""

from __future__ import annotations

import os

# Tests run on a 2-core machine that other processes share: one intra-op thread per test
# process avoids torch's threads spinning against each other (several times slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
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
