"""Tests of the engine as a whole: AsyncEngine, LLM, models and kernels in the loop, tensor parallelism."""
