def pytest_configure(config):
    config.addinivalue_line(
        "markers", "quick: the few triton tests that `benchmarks/gpu_check.py --quick` runs (one per kernel path)"
    )
