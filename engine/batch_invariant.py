"""`--batch-invariant`: a row's result does not depend on the other rows of its batch.

When enabled (once, at start-up, in each process that runs the model):
- every packed linear (int4/int8, GGUF blocks) takes its few-row kernel for any batch
  size, whose per-row arithmetic is the same for 1 row or 256 (the int4/int8 kernel
  also leaves its one-row and 8-row-block variants, which round in another order);
- every attention row, prompt chunks of any length included, runs the in-place C++
  kernel, one row at a time, instead of SDPA for long chunks.
So the same request alone or beside 31 others gives bitwise-equal tokens and logprobs,
whether its prompt came from the prefix cache, a chunk or a decode step. Dense
(unquantized) linears still use the BLAS matmul, which is not batch invariant.
"""

from __future__ import annotations

_enabled = False


def set_enabled(enabled: bool) -> None:
    """Switch batch invariance on or off for this process (and its C++ kernels)."""
    global _enabled
    _enabled = bool(enabled)
    from pagedserve_kernels.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is not None:
        kernels.set_batch_invariant(_enabled)


def enabled() -> bool:
    return _enabled
