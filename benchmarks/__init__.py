"""Benchmarks: scripts that measure, never assert (run them with `python -m benchmarks.<name>`)."""
