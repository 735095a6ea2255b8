"""Tensor parallelism: the process group, how tensors are sharded, and the worker ranks.

    parallel_state   this process's rank in the tensor-parallel group and its collectives
    sharding         which rows/columns/heads of a checkpoint tensor each rank holds
    messages         the typed messages between the engine core and the worker ranks
    worker           the entry point of a worker rank process
    launcher         the processes of one node (head: spawned by the executor; others:
                     `pagedserve serve --node-rank N`)
"""
