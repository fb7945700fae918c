"""Benchmarks: side-by-side measurements against named peers (see shared BENCHMARKING rules)."""

__all__: list[str] = []
