"""pagedserve_kernels/cpu/spin_pool.h, the fork-join pool of the C++ kernels, through a kernel.

The int4 linear splits its output rows over the pool; each output element is computed
by one thread in a fixed order, so results are bit-identical however the rows are split,
whether the call ran on the pool, inline (a second caller at the same time), or in a
forked child (which must build its own workers instead of waiting for its parent's).
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from engine.models.quant import QuantSpec, quantize
from pagedserve_kernels.cpu_kernels import cpu_kernels, toolchain_available

pytestmark = pytest.mark.skipif(not toolchain_available(), reason="no C++ toolchain")


@pytest.fixture(scope="module")
def linear():
    assert cpu_kernels() is not None, "the C++ kernels did not build"
    torch.manual_seed(0)
    weight = quantize(torch.randn(1000, 256) * 0.02, QuantSpec("int4"), max_rows=64)
    x = torch.randn(3, 256)
    with torch.inference_mode():
        one_thread = _with_threads(1, lambda: weight.matmul(x, None))
    return weight, x, one_thread


def _with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def test_split_over_threads_gives_the_same_bits(linear):
    weight, x, one_thread = linear
    with torch.inference_mode():
        for _ in range(50):  # many fork-joins: a lost wake-up would hang here
            assert torch.equal(_with_threads(2, lambda: weight.matmul(x, None)), one_thread)


def test_concurrent_callers_each_get_their_own_result(linear):
    weight, x, one_thread = linear
    x2 = x.flip(0).contiguous()
    with torch.inference_mode():
        expected2 = _with_threads(1, lambda: weight.matmul(x2, None))
    failures: list[str] = []

    def caller(inputs, expected):
        with torch.inference_mode():
            for _ in range(100):
                if not torch.equal(weight.matmul(inputs, None), expected):
                    failures.append("wrong result")
                    return

    threads = [threading.Thread(target=caller, args=(x, one_thread)),
               threading.Thread(target=caller, args=(x2, expected2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a caller hung"
    assert failures == []


def _child(weight, x, queue):
    torch.set_num_threads(2)
    with torch.inference_mode():
        queue.put(weight.matmul(x, None).tolist())  # plain floats: no shared-memory handoff


def test_a_forked_child_builds_its_own_workers(linear):
    weight, x, one_thread = linear
    with torch.inference_mode():
        weight.matmul(x, None)  # the parent's pool exists before the fork
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(weight, x, queue))
    child.start()
    try:
        result = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert torch.equal(torch.tensor(result), one_thread)
