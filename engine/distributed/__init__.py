"""Tensor parallelism inside a rank: the process group and how tensors are sharded.

    parallel_state      this process's rank in the tensor-parallel group and its collectives
    sharding            which rows/columns/heads of a checkpoint tensor each rank holds
    sampling            every rank samples; rank 0's tokens are broadcast and kept

The worker processes and the executor that runs them are in engine/executor/;
docs/tensor-parallel.md describes the whole design.
"""
