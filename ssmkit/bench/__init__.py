"""Benchmarks behind the `ssmkit bench` commands; results are recorded in docs/benchmarks.md."""
