"""Benchmarks (commands: benchmarks/README.md).

Kernels measured in this process run under the OpenMP settings the engine core runs under
(engine/frontend/core_client.py): with spinning OpenMP threads, torch's own parallel ops
between two kernels (a bf16 -> float32 copy of more than 32,768 values, say) leave threads
spinning that take the cores from the kernels' pool, and a few-row kernel measured up to
twice its served time (docs/cpu-kernels.md). A value the user set is kept.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
