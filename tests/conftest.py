"""Suite-wide hooks: tests marked `gpu` are skipped where no CUDA device is usable.

Run only them (on a GPU machine): `pytest -m gpu` (benchmarks/gpu_check.sh does).
Tests marked `extended` (long multi-process scenarios) run only with
PAGEDSERVE_EXTENDED_TESTS=1, which keeps `make test` near 10 minutes on 2 cores.
"""

from __future__ import annotations

import os

import pytest


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
