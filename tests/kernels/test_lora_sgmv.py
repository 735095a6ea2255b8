"""pagedserve_kernels/lora_sgmv.py (the Triton LoRA kernels) against a float64
shrink-then-expand per adapter group, through LinearLoRA's Triton path: compiled on CUDA,
under the Triton interpreter on the CPU (rerun in a fresh process when triton was already
imported in compiled mode, as tests/kernels/test_attention_kernels.py does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.attention.forward_context import LoRAMapping
from engine.lora.layers import LinearLoRA, flat_groups
from pagedserve_kernels.lora_sgmv import piece_tiles
from tests.support.attention_cases import DEVICE, HAS_TRITON, IN_PROCESS, needs_kernels
from tests.support.lora_kernel_cases import IN, PIECES, adapter, reference

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def triton_path(monkeypatch):
    """LinearLoRA takes its Triton path for tensors on DEVICE (the CPU: the interpreter)."""
    monkeypatch.setattr("engine.lora.layers.use_triton", lambda x: True)


def layer_of(adapters, layout=PIECES) -> LinearLoRA:
    layer = LinearLoRA(layout)
    for lora_id, weights in adapters.items():
        layer.set_adapter(lora_id, {p: (a.to(DEVICE), b.to(DEVICE))
                                    for p, (a, b) in weights.items()})
    return layer


def on_device(groups):
    return [(lora_id, None if rows is None else rows.to(DEVICE)) for lora_id, rows in groups]


def test_piece_tiles_worked_example():
    assert piece_tiles([(0, 64), (64, 16)], 16, block_n=32).tolist() == \
        [[0, 32, 0], [32, 64, 0], [64, 80, 16]]


def test_flat_groups_worked_example():
    mapping = LoRAMapping([(3, torch.tensor([1, 2])), (5, torch.tensor([3]))])
    flat = flat_groups(mapping, 4, torch.device("cpu"))
    assert flat.rows.tolist() == [1, 2, 3] and flat.group_start.tolist() == [0, 2, 3]
    assert flat.lora_ids.tolist() == [3, 5] and (flat.max_lora_id, flat.max_tokens) == (5, 2)
    assert flat_groups(mapping, 4, torch.device("cpu")) is flat  # once a step


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_lora_add_matches_a_float64_shrink_then_expand(triton_path, dtype):
    adapters = {1: adapter(1, 8, [0, 2], dtype), 2: adapter(2, 4, [0, 1, 2], dtype),
                7: adapter(3, 16, [1], dtype)}
    layer = layer_of(adapters)
    x = torch.randn(7, IN).to(dtype)
    out = torch.randn(7, 96).to(dtype)
    # Adapter 9 is in the step but does not adapt this linear: its token is left alone.
    groups = [(1, torch.tensor([0, 3, 4])), (2, torch.tensor([5])), (7, torch.tensor([1, 6])),
              (9, torch.tensor([2]))]
    want = reference(out, x, groups[:3], adapters)
    got = out.to(DEVICE, copy=True)
    layer.add_to(got, x.to(DEVICE), LoRAMapping(on_device(groups)))
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.cpu().double(), want, rtol=tolerance, atol=tolerance * 10)
    assert torch.equal(got[2].cpu(), out[2])  # adapter 9's and the base's rows: untouched

    # One group over every row (rows None), as a step of one adapter sends it.
    every = torch.zeros(7, 96, dtype=dtype, device=DEVICE)
    layer.add_to(every, x.to(DEVICE), LoRAMapping([(2, None)]))
    torch.testing.assert_close(every.cpu().double(),
                               reference(torch.zeros(7, 96), x, [(2, None)], adapters),
                               rtol=tolerance, atol=tolerance * 10)


@needs_kernels
def test_triton_shapes_past_the_tiles(triton_path):
    """Widths that are not multiples of the tiles, a piece of several column tiles, odd
    ranks, groups of more tokens than one row tile; then an adapter dropped and another
    added (the slot stack is rebuilt)."""
    layout, in_features = [(0, 300), (300, 37)], 83
    adapters = {1: adapter(1, 5, [0, 1], layout=layout, in_features=in_features),
                4: adapter(2, 3, [1], layout=layout, in_features=in_features)}
    layer = layer_of(adapters, layout)
    x, out = torch.randn(41, in_features), torch.randn(41, 337)
    groups = [(1, torch.arange(0, 41, 2)), (4, torch.arange(1, 41, 2))]
    got = out.to(DEVICE, copy=True)
    layer.add_to(got, x.to(DEVICE), LoRAMapping(on_device(groups)))
    torch.testing.assert_close(got.cpu().double(), reference(out, x, groups, adapters, layout),
                               rtol=1e-4, atol=1e-4)

    layer.drop_adapter(1)
    adapters = {4: adapters[4], 12: adapter(5, 16, [0], layout=layout, in_features=in_features)}
    layer.set_adapter(12, {p: (a.to(DEVICE), b.to(DEVICE)) for p, (a, b) in adapters[12].items()})
    groups = [(12, torch.arange(0, 41, 3)), (4, torch.tensor([1, 2]))]
    got = out.to(DEVICE, copy=True)
    layer.add_to(got, x.to(DEVICE), LoRAMapping(on_device(groups)))
    torch.testing.assert_close(got.cpu().double(), reference(out, x, groups, adapters, layout),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(IN_PROCESS or not HAS_TRITON, reason="kernel tests run in this process")
def test_kernels_in_fresh_process():
    """Triton was imported in compiled mode before these tests on a CPU-only machine:
    rerun this file where the interpreter can be switched on."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
