"""Benchmarks run through `rayserve-paged bench NAME`."""
