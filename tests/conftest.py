"""Suite-wide hooks: tests marked `gpu` are skipped where no CUDA device is usable.

Run only them (on a GPU machine): `pytest -m gpu` (benchmarks/gpu_check.sh does).
The packed kernels' activations are int16 throughout (below). Tests marked `extended` (long multi-process scenarios) run only with
PAGEDSERVE_EXTENDED_TESTS=1, which keeps `make test` near 10 minutes on 2 cores.
"""

from __future__ import annotations

import os

import pytest

# The suite runs the packed kernels' int16 activation path (the reference, closest to the
# float model) on every CPU, so that its results do not depend on the CPU family CI draws;
# int8, the default on AVX-512 VNNI CPUs, is tested by name (tests/kernels/test_int8_activations.py,
# tests/kernels/test_quant.py, tests/engine/test_default_model.py).
os.environ.setdefault("PAGEDSERVE_ACTIVATION_PRECISION", "int16")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PAGEDSERVE_EXTENDED_TESTS") != "1":
        skip_extended = pytest.mark.skip(reason="extended: set PAGEDSERVE_EXTENDED_TESTS=1")
        for item in items:
            if item.get_closest_marker("extended") is not None:
                item.add_marker(skip_extended)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in gpu_items:
        item.add_marker(skip)
