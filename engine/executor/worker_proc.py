"""A worker rank's process: join the group, load its shard, then run steps as told.

    engine core (MultiprocExecutor)            worker rank r (this module)
    ROUTER tcp://...  ◀──────── DEALER, identity b"rank<r>"
                                   init_tensor_parallel, Worker.load()
                      ◀──────── WorkerReady(r, blocks that fit)
    InitKVCache(n)    ────────▶  allocate n blocks
                      ◀──────── KVCacheReady(r)
    Step(output)      ────────▶  Worker.execute_model (every rank; collectives inside)
                      ◀──────── StepDone (rank 0 only)
    Stop              ────────▶  exit 0

Any exception sends WorkerFailed and exits 1. The rank also exits when its parent
process is gone or when its connection to the engine core drops (the core was
killed): no rank outlives the server.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.worker.executor import RankInfo

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


def rank_identity(rank: int) -> bytes:
    return f"rank{rank}".encode()


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to start (its process arguments)."""

    config: EngineConfig
    rank: RankInfo
    dist_init_method: str  # e.g. "tcp://127.0.0.1:29500"
    dist_backend: str  # "gloo" | "nccl"
    control_address: str  # the engine core's ROUTER socket
    cpus: tuple[int, ...]  # pin to these (empty: do not pin)
    num_threads: int
    log_level: str = "INFO"
    # The starter's settings read from the environment (PAGEDSERVE_*, OMP_*, NCCL_*, ...):
    # a forkserver started earlier holds the environment of that moment, not this one.
    env: tuple[tuple[str, str], ...] = ()
    # Ranks the engine core spawned ignore SIGINT/SIGTERM: the server drains first and
    # then stops them (Stop); a terminal's Ctrl-C must not kill them mid-drain.
    ignore_signals: bool = True


ENV_PREFIXES = ("PAGEDSERVE_", "OMP_", "KMP_", "GLOO_", "NCCL_", "CUDA_VISIBLE_DEVICES",
                "TORCH_", "HF_")


def env_snapshot() -> tuple[tuple[str, str], ...]:
    """The settings of this process's environment a worker rank must see."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)))


def apply_env(env: tuple[tuple[str, str], ...]) -> None:
    """Make this process's settings exactly `env` (those with ENV_PREFIXES)."""
    for key in [k for k in os.environ if k.startswith(ENV_PREFIXES)]:
        del os.environ[key]
    os.environ.update(dict(env))


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(_PARENT_POLL_S)


def run_worker(spec: WorkerSpec) -> None:
    """Process entry point (start method spawn). Exits 0 after Stop, 1 on failure."""
    import torch
    import zmq

    from engine.distributed.parallel_state import init_tensor_parallel
    from engine.executor.messages import (
        InitKVCache,
        KVCacheReady,
        Step,
        StepDone,
        Stop,
        WorkerFailed,
        WorkerReady,
        worker_side_codec,
    )
    from engine.worker.executor import Worker

    rank = spec.rank.rank
    apply_env(spec.env)
    if spec.ignore_signals:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [tp-rank {rank} pid={os.getpid()}] "
               "%(name)s: %(message)s")
    # The parent is the process that started this one (the engine core, the node
    # launcher, or their forkserver, which exits with them): its exit ends this rank.
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True,
                     name="parent-watch").start()
    if spec.cpus:
        from engine import cpu_info

        cpu_info.pin_this_process(spec.cpus)
    torch.set_num_threads(spec.num_threads)

    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, rank_identity(rank))
    socket.setsockopt(zmq.LINGER, 2000)
    socket.connect(spec.control_address)
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    codec = worker_side_codec()

    def send(message) -> None:
        socket.send(codec.encode(message), copy=False)

    exit_code = 0
    try:
        logger.info("joining the process group (%s, %s) as rank %d of %d; %d compute "
                    "thread(s)%s", spec.dist_backend, spec.dist_init_method, rank,
                    spec.rank.size, spec.num_threads,
                    f" on CPUs {list(spec.cpus)}" if spec.cpus else "")
        init_tensor_parallel(
            rank, spec.rank.size, spec.dist_init_method, spec.dist_backend,
            expert_parallel=spec.config.parallel_config.enable_expert_parallel)
        worker = Worker(spec.config, spec.rank)
        fits = worker.load()
        send(WorkerReady(rank, os.getpid(), fits, worker.max_model_len, worker.vocab_size,
                         worker.kv_cache_groups))
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if monitor in events:
                monitor.recv_multipart()
                raise ConnectionError("the connection to the engine core closed")
            message = codec.decode(socket.recv(copy=False).buffer)
            if isinstance(message, Step):
                output = worker.execute_model(message.scheduler_output)
                if rank == 0:
                    send(StepDone(output))
            elif isinstance(message, InitKVCache):
                worker.init_kv_cache(message.num_blocks)
                send(KVCacheReady(rank))
            elif isinstance(message, Stop):
                break
    except BaseException as exc:  # noqa: BLE001 - report every failure, then exit
        logger.error("tensor-parallel rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        first_line = (str(exc).strip().splitlines() or [""])[0]
        send(WorkerFailed(rank, f"{type(exc).__name__}: {first_line}", traceback.format_exc()))
        exit_code = 1
    socket.disable_monitor()
    monitor.close(linger=0)
    socket.close()
    context.term()
    os._exit(exit_code)  # skip interpreter teardown (a peer may be gone mid-collective)
