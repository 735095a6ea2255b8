"""Tests of the project's benchmark harness (benchmarks/)."""
