"""pagedserve_kernels/cpu/lora.cpp against a float64 reference: the LoRA side path of a
merged linear (pieces), several adapter groups over chosen rows and one over every row,
each dtype (x, out and the adapter's weights in it); a row's result does not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

import pagedserve_kernels.cpu_kernels
from engine.attention.forward_context import LoRAMapping
from engine.lora.layers import LinearLoRA
from tests.support.lora_kernel_cases import IN, PIECES, adapter, reference

needs_kernels = pytest.mark.skipif(not pagedserve_kernels.cpu_kernels.toolchain_available(),
                                   reason="no C++ compiler/ninja to build the CPU kernels")
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lora_add_matches_a_float64_shrink_then_expand(dtype):
    adapters = {1: adapter(1, 8, [0, 2], dtype), 2: adapter(2, 4, [0, 1, 2], dtype),
                3: adapter(3, 16, [1], dtype)}
    layer = LinearLoRA(PIECES)
    for lora_id, weights in adapters.items():
        layer.set_adapter(lora_id, weights)
    x = torch.randn(7, IN, dtype=torch.float32).to(dtype)
    out = torch.randn(7, 96, dtype=torch.float32).to(dtype)
    groups = [(1, torch.tensor([0, 3, 4])), (2, torch.tensor([5])), (3, torch.tensor([1, 6]))]
    want = reference(out, x, groups, adapters)
    layer.add_to(out, x, LoRAMapping(groups))
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance * 10)
    untouched = want[2]  # row 2 is the base's: no adapter adds to it
    assert torch.equal(out[2].double(), untouched)

    # One group over every row (rows None), as a step of one adapter sends it.
    out_all = torch.zeros(7, 96, dtype=dtype)
    layer.add_to(out_all, x, LoRAMapping([(2, None)]))
    torch.testing.assert_close(out_all.double(), reference(torch.zeros(7, 96), x, [(2, None)],
                                                           adapters),
                               rtol=tolerance, atol=tolerance * 10)


@needs_kernels
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    layer = LinearLoRA(PIECES)
    layer.set_adapter(1, adapter(5, 8, [0, 1, 2]))
    x = torch.randn(9, IN)
    alone = torch.zeros(1, 96)
    layer.add_to(alone, x[4:5].clone(), LoRAMapping([(1, None)]))
    batch = torch.zeros(9, 96)
    layer.add_to(batch, x, LoRAMapping([(1, None)]))
    assert torch.equal(batch[4], alone[0])


@needs_kernels
def test_shapes_past_the_tiles():
    """An input width and piece widths that are not multiples of the vector width, a piece
    wider than one expand task, odd ranks, and row counts that leave tails in the row tiles."""
    layout, in_features = [(0, 300), (300, 37)], 53
    adapters = {1: adapter(1, 5, [0, 1], layout=layout, in_features=in_features),
                2: adapter(2, 3, [1], layout=layout, in_features=in_features)}
    layer = LinearLoRA(layout)
    for lora_id, weights in adapters.items():
        layer.set_adapter(lora_id, weights)
    x, out = torch.randn(11, in_features), torch.randn(11, 337)
    groups = [(1, torch.tensor([0, 1, 2, 3, 4, 5, 7])), (2, torch.tensor([6, 8, 9, 10]))]
    want = reference(out, x, groups, adapters, layout)
    layer.add_to(out, x, LoRAMapping(groups))
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


def test_the_torch_path_matches_too(monkeypatch):
    """Where the kernels are absent (CUDA, no compiler): the same numbers from torch."""
    monkeypatch.setattr("engine.lora.layers.fused_ops_for", lambda tensor: None)
    adapters = {1: adapter(1, 8, [0, 2]), 2: adapter(2, 4, [1])}
    layer = LinearLoRA(PIECES)
    for lora_id, weights in adapters.items():
        layer.set_adapter(lora_id, weights)
    x, out = torch.randn(5, IN), torch.randn(5, 96)
    groups = [(1, torch.tensor([0, 2])), (2, torch.tensor([1, 2, 4]))]
    want = reference(out, x, groups, adapters)
    layer.add_to(out, x, LoRAMapping(groups))
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
