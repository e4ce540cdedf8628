"""Benchmarks: workloads, runners and reports (scripts, not tests)."""
