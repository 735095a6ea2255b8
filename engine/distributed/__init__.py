"""Tensor parallelism: the process group, how tensors are sharded, and the worker ranks.

    parallel_state      this process's rank in the tensor-parallel group and its collectives
    sharding            which rows/columns/heads of a checkpoint tensor each rank holds
    sampling            every rank samples; rank 0's tokens are broadcast and kept
    messages            the typed messages between the engine core and the worker ranks
    multiproc_executor  the engine core's side: start the ranks, broadcast steps, watch them
    worker_proc         the entry point of a worker rank process
    launcher            a node that runs only worker ranks (`serve --node-rank N`, N > 0)

docs/tensor-parallel.md describes the whole design.
"""
