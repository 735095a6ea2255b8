"""Benchmarks (commands: benchmarks/README.md).

Kernels measured in this process run under the OpenMP settings a decoder's engine core runs
under (engine/openmp.py): with spinning OpenMP threads, torch's own parallel ops
between two kernels (a bf16 -> float32 copy of more than 32,768 values, say) leave threads
spinning that take the cores from the kernels' pool, and a few-row kernel measured up to
twice its served time (docs/cpu-kernels.md). A value the user set is kept. Servers started
by a benchmark get `server_environment()`: without that default, so that each engine core
picks its own (an encoder's differs: engine/openmp.py).
"""

import os

_DEFAULTED = "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def server_environment() -> dict[str, str]:
    """This process's environment for a server it starts, less the OpenMP default above."""
    env = dict(os.environ)
    if _DEFAULTED:
        env.pop("OMP_WAIT_POLICY", None)
    return env
