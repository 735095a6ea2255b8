"""Reliability of a running server: disconnects, faults, limits, long prompts, shutdown, fuzzing."""
