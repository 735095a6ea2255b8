"""This process's place in the tensor-parallel group, and the collectives layers call.

A process that never called `init_tensor_parallel` is a group of one: rank 0 of 1,
and every collective returns its input. So the models build and run unchanged in
the one-process executor and in tests; the worker ranks of the multiprocess executor
call `init_tensor_parallel` before building their model, and the layers read the
group at construction (which shard to hold) and at run time (what to reduce).

Collectives go through `torch.distributed` only: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    # MoE layers: True = each rank holds whole experts, a 1/size share of them (expert
    # parallel); False = every rank holds every expert's 1/size share of columns.
    expert_parallel: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in place; returns x)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's x [..., n] side by side along the last dim: [..., size * n], rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (in place; returns x)."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x


_GROUP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _GROUP


@contextmanager
def whole_model_on_each_rank() -> Iterator[None]:
    """Build or run a model that every rank holds whole (the draft model of speculative
    decoding): inside, this process is a group of one (no shards, no collectives);
    its real group again after."""
    global _GROUP
    saved = _GROUP
    _GROUP = TensorParallelGroup()
    try:
        yield
    finally:
        _GROUP = saved


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str,
                         timeout_s: float = 600.0,
                         expert_parallel: bool = False) -> TensorParallelGroup:
    """Join the process group (`init_method` e.g. "tcp://127.0.0.1:29500") as `rank`."""
    global _GROUP
    if size > 1:
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _GROUP = TensorParallelGroup(rank, size, expert_parallel)
    return _GROUP


def set_tp_group_for_tests(rank: int, size: int, expert_parallel: bool = False) -> None:
    """Build models as rank `rank` of `size` without a process group (shape tests only)."""
    global _GROUP
    _GROUP = TensorParallelGroup(rank, size, expert_parallel)
