"""A node that runs only worker ranks: `pagedserve serve --nnodes N --node-rank n` (n > 0).

    node 0:  pagedserve serve --tensor-parallel-size 4 --nnodes 2 --node-rank 0 \
                 --master-addr 10.0.0.1 --master-port 29500         (server, core, ranks 0-1)
    node 1:  pagedserve serve --tensor-parallel-size 4 --nnodes 2 --node-rank 1 \
                 --master-addr 10.0.0.1 --master-port 29500         (ranks 2-3)

The ranks here connect to the engine core's control socket (master port + 1) and
join the process group at the master address; they follow node 0's steps until it
sends Stop or goes away. SIGTERM/SIGINT here stops them at once.
"""

from __future__ import annotations

import logging
import signal
import threading

from engine.config import EngineConfig
from engine.executor.multiproc_executor import (
    control_port,
    describe_exit,
    start_workers,
    stop_processes,
    worker_specs,
)

logger = logging.getLogger(__name__)


def run_worker_node(config: EngineConfig, log_level: str = "INFO") -> int:
    """Run this node's ranks until they exit; 0 if all exited cleanly (node 0 stopped them)."""
    parallel = config.parallel_config
    if parallel.master_port is None:
        raise ValueError("--node-rank > 0 needs --master-addr and --master-port (node 0's)")
    specs = worker_specs(
        config, parallel.node_rank,
        dist_init_method=f"tcp://{parallel.master_addr}:{parallel.master_port}",
        control_address=f"tcp://{parallel.master_addr}:{control_port(parallel)}",
        ignore_signals=True, log_level=log_level)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    logger.info("node %d of %d: starting tensor-parallel ranks %s (engine core at %s:%d)",
                parallel.node_rank, parallel.nnodes, [s.rank.rank for s in specs],
                parallel.master_addr, control_port(parallel))
    processes = start_workers(specs)
    try:
        while not stop.is_set() and all(p.is_alive() for p in processes.values()):
            stop.wait(0.2)
    finally:
        if stop.is_set():
            logger.info("signal received: stopping the ranks of this node")
            stop_processes(processes, grace_s=0.0)
        else:
            stop_processes(processes)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = {rank: p.exitcode for rank, p in processes.items()}
    for rank, code in codes.items():
        if code:
            logger.error("tensor-parallel rank %d exited: %s", rank, describe_exit(code))
    return 0 if stop.is_set() or not any(codes.values()) else 1
