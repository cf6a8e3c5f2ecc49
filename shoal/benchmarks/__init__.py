"""Benchmark clients (see BENCHMARKS.md for the workloads)."""
