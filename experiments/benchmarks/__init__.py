"""Benchmarks: each script writes its numbers to ``results/``."""
