"""Benchmark scripts: python -m benchmarks.<name>; results with their commands in RESULTS.md."""
