"""Tests of the C++/Triton kernels against their references, one file per kernel family."""
