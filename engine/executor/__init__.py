"""Executors: what runs the model for the engine core.

    abstract            the Executor contract, make_executor, ExecutorSpec
    multiproc_executor  one worker process per tensor-parallel rank: start them, broadcast
                        each step, watch them
    worker_proc         the entry point of a worker rank process
    messages            the typed messages between the engine core and the worker ranks
    launcher            a node that runs only worker ranks (`serve --node-rank N`, N > 0)

The one-process executor (ModelExecutor) and the Worker both sit in
engine/worker/executor.py; docs/tensor-parallel.md describes the multiprocess design.
"""
