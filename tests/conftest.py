"""Suite-wide hooks: tests marked `gpu` are skipped where no CUDA device is usable.

Run only them (on a GPU machine): `pytest -m gpu` (benchmarks/gpu_check.sh does).
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in gpu_items:
        item.add_marker(skip)
