"""engine.openmp.small_ops_on_this_thread: a few rows of logits run their torch ops on the
calling thread alone; larger tensors keep torch's threads; the count always comes back."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.openmp import SMALL_OP_VALUES, small_ops_on_this_thread


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_few_rows_run_on_one_thread_and_the_count_comes_back(two_threads):
    logits = torch.zeros(2, SMALL_OP_VALUES // 2)
    with small_ops_on_this_thread(logits):
        assert torch.get_num_threads() == 1
        probs = torch.softmax(logits, dim=-1)
    assert torch.get_num_threads() == 2
    assert torch.allclose(probs.sum(-1), torch.ones(2))


def test_a_larger_tensor_keeps_torch_threads(two_threads):
    with small_ops_on_this_thread(torch.zeros(SMALL_OP_VALUES + 1)):
        assert torch.get_num_threads() == 2


def test_the_count_comes_back_after_an_error(two_threads):
    with pytest.raises(RuntimeError), small_ops_on_this_thread(torch.zeros(4, 8)):
        raise RuntimeError("a sampler failure")
    assert torch.get_num_threads() == 2


def test_another_thread_keeps_its_count_meanwhile(two_threads):
    """OpenMP's count is each thread's own: the async worker thread's model step keeps
    both threads while another thread samples."""
    seen: list[int] = []
    ready, inside, done = threading.Event(), threading.Event(), threading.Event()

    def other() -> None:
        torch.get_num_threads()  # a thread takes its count the first time it asks (a kernel)
        ready.set()
        inside.wait(10)
        seen.append(torch.get_num_threads())
        done.set()

    worker = threading.Thread(target=other)
    worker.start()
    ready.wait(10)
    with small_ops_on_this_thread(torch.zeros(8)):
        inside.set()
        done.wait(10)
    worker.join()
    assert seen == [2]
