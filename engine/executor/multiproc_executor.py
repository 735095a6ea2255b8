"""The multiprocess executor: one worker process per tensor-parallel rank.

The engine core never computes here: each step it sends the SchedulerOutput to every
rank (one encoded message, sent to each over one ZMQ ROUTER socket), and waits for
rank 0's sampled tokens (all ranks sample the same tokens: they hold the same
gathered logits and rank 0's choice is broadcast). While it waits it also watches
every local rank's process sentinel, so a rank that dies (kill -9, OOM) ends the wait
at once with `WorkerDiedError`, which the engine treats as fatal.

Several nodes (torchrun's meaning of the flags): node 0 runs the server, the engine
core and ranks [0, k); node n runs ranks [n*k, (n+1)*k) only (`engine.distributed.
launcher`), all joining the process group at --master-addr:--master-port; the core's
control socket listens on --master-port + 1.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket as socketlib
import time
import weakref
from multiprocessing.process import BaseProcess

import torch
import zmq

from engine.config import EngineConfig, ParallelConfig
from engine.distributed.sharding import check_tensor_parallel
from engine.executor.messages import (
    InitKVCache,
    KVCacheReady,
    Step,
    StepDone,
    Stop,
    WorkerFailed,
    WorkerReady,
    core_side_codec,
)
from engine.executor.worker_proc import WorkerSpec, env_snapshot, rank_identity, run_worker
from engine.outputs import KVCacheInfo, ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.worker.executor import RankInfo, choose_num_blocks, resolve_device

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("PAGEDSERVE_TP_STARTUP_TIMEOUT_S", "600"))
STOP_GRACE_S = 5.0


class WorkerDiedError(BaseException):
    """A worker rank is gone: the engine cannot go on (the other ranks wait for it in
    every collective). A BaseException so that the engine core's per-step
    `except Exception` (which fails one step's requests and carries on) lets it through
    to the core loop, which reports the engine dead."""


def describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def free_port(host: str = "127.0.0.1") -> int:
    with socketlib.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def control_port(parallel: ParallelConfig) -> int:
    """The engine core's control socket in a multi-node group: --master-port + 1."""
    return parallel.master_port + 1


def dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def plan_rank_cpus(allowed: tuple[int, ...], num_threads: int, num_ranks: int
                   ) -> list[tuple[tuple[int, ...], int]]:
    """(CPUs to pin to, compute threads) of each local rank: an equal share of the
    CPUs, never fewer than one thread.

    Example: allowed (0, 1, 2, 3), 4 threads, 2 ranks -> [((0, 1), 2), ((2, 3), 2)].
    Allowed (0, 1), 3 ranks -> [((0,), 1), ((1,), 1), ((0,), 1)]: rank 2 shares CPU 0.
    """
    share = max(1, len(allowed) // num_ranks)
    threads = max(1, min(share, num_threads // num_ranks))
    plan = []
    for local_rank in range(num_ranks):
        if len(allowed) >= num_ranks:
            cpus = allowed[local_rank * share : (local_rank + 1) * share]
        else:
            cpus = (allowed[local_rank % len(allowed)],)
        plan.append((cpus, threads))
    return plan


def node_ranks(parallel: ParallelConfig, node_rank: int) -> range:
    """The global ranks of one node. Example: TP 4 over 2 nodes -> node 1 runs [2, 4)."""
    size, nnodes = parallel.tensor_parallel_size, parallel.nnodes
    if size % nnodes:
        raise ValueError(f"--nnodes {nnodes} does not divide --tensor-parallel-size {size}")
    per_node = size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def worker_specs(config: EngineConfig, node_rank: int, dist_init_method: str,
                 control_address: str, ignore_signals: bool, log_level: str) -> list[WorkerSpec]:
    """The specs of the ranks that run on node `node_rank`."""
    from engine import cpu_info

    parallel = config.parallel_config
    ranks = node_ranks(parallel, node_rank)
    device = resolve_device(config.device_config.device)
    budget = cpu_info.cpu_budget()
    cpu_plan = plan_rank_cpus(budget.affinity,
                              config.device_config.cpu_threads or budget.num_threads, len(ranks))
    specs = []
    for local_rank, rank in enumerate(ranks):
        cpus, threads = cpu_plan[local_rank]
        specs.append(WorkerSpec(
            config=config,
            rank=RankInfo(rank, parallel.tensor_parallel_size, local_rank, len(ranks)),
            dist_init_method=dist_init_method, dist_backend=dist_backend(device),
            control_address=control_address,
            cpus=cpus if device.type == "cpu" else (), num_threads=threads,
            log_level=log_level, ignore_signals=ignore_signals, env=env_snapshot()))
    return specs


# Modules a worker needs, imported once by the forkserver and inherited by every rank
# it forks: a rank then starts in well under a second instead of importing torch and
# transformers anew (seconds each). The forkserver itself never computes, so it holds
# no thread pools and no CUDA context; PAGEDSERVE_TP_START_METHOD=spawn opts out.
_PRELOAD = ["torch", "transformers", "engine.executor.worker_proc", "engine.worker.executor",
            "engine.model_loader", "engine.models",
            # AutoConfig imports these lazily, and with them most of transformers
            "transformers.models.llama.configuration_llama",
            "transformers.models.qwen2.configuration_qwen2",
            "transformers.models.qwen3.configuration_qwen3",
            "transformers.models.qwen3_moe.configuration_qwen3_moe"]


def _mp_context():
    method = os.environ.get("PAGEDSERVE_TP_START_METHOD", "forkserver")
    if method not in multiprocessing.get_all_start_methods():
        method = "spawn"
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(_PRELOAD)
    return context


def start_workers(specs: list[WorkerSpec]) -> dict[int, BaseProcess]:
    context = _mp_context()
    processes = {}
    for spec in specs:
        process = context.Process(target=run_worker, args=(spec,),
                                  name=f"TPWorker-{spec.rank.rank}")
        process.start()
        processes[spec.rank.rank] = process
    return processes


def stop_processes(processes: dict[int, BaseProcess], grace_s: float = STOP_GRACE_S) -> None:
    """Wait up to `grace_s` for the processes to exit, then SIGKILL the rest and reap them."""
    deadline = time.monotonic() + grace_s
    for process in processes.values():
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for rank, process in processes.items():
        if process.is_alive():
            logger.warning("tensor-parallel rank %d (pid %s) did not stop; killing it", rank,
                           process.pid)
            process.kill()
            process.join(timeout=5)


class MultiprocExecutor:
    """`initialize` / `execute_model` / `shutdown` over worker processes (see module doc)."""

    def __init__(self, config: EngineConfig, log_level: str | None = None):
        self.config = config
        self.size = config.parallel_config.tensor_parallel_size
        self.log_level = log_level or logging.getLevelName(logging.getLogger().level)
        if not isinstance(self.log_level, str) or self.log_level.startswith("Level"):
            self.log_level = "INFO"
        self.processes: dict[int, BaseProcess] = {}
        self._codec = core_side_codec()
        self._context: zmq.Context | None = None
        self._closed = False

    # ---------------------------------------------------------------- start-up
    def initialize(self) -> KVCacheInfo:
        from transformers import AutoConfig

        from engine.model_loader import resolve_model

        config, parallel = self.config, self.config.parallel_config
        model_dir = resolve_model(config.model_config.model,  # converts a GGUF once, here
                                  mmproj=config.model_config.mmproj).path
        check_tensor_parallel(AutoConfig.from_pretrained(model_dir), self.size)
        node_ranks(parallel, 0)
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        if parallel.nnodes == 1:
            port = self._router.bind_to_random_port("tcp://127.0.0.1")
            control_address = f"tcp://127.0.0.1:{port}"
            master_port = parallel.master_port or free_port()
            init_method = f"tcp://127.0.0.1:{master_port}"
        else:
            if parallel.master_port is None:
                raise ValueError("--nnodes > 1 needs --master-port (and --master-addr)")
            self._router.bind(f"tcp://*:{control_port(parallel)}")
            control_address = f"tcp://{parallel.master_addr}:{control_port(parallel)}"
            init_method = f"tcp://{parallel.master_addr}:{parallel.master_port}"
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        specs = worker_specs(config, 0, init_method, control_address, ignore_signals=True,
                             log_level=self.log_level)
        logger.info("tensor parallel size %d: starting %d worker rank(s) here%s (%s)",
                    self.size, len(specs),
                    f", {self.size - len(specs)} on {parallel.nnodes - 1} other node(s)"
                    if parallel.nnodes > 1 else "", init_method)
        self.processes = start_workers(specs)
        self._finalizer = weakref.finalize(self, stop_processes, dict(self.processes), 0.0)
        try:
            readies = self._gather(WorkerReady, STARTUP_TIMEOUT_S, starting=True)
            first = readies[0]
            num_blocks = choose_num_blocks(config, [r.num_blocks for r in readies],
                                           first.max_model_len)
            self._broadcast(InitKVCache(num_blocks))
            self._gather(KVCacheReady, STARTUP_TIMEOUT_S, starting=True)
        except BaseException:
            self.shutdown(grace_s=0.0)  # the others may wait for the failed rank forever
            raise
        return KVCacheInfo(num_blocks, config.cache_config.block_size, first.max_model_len,
                           first.vocab_size, first.kv_cache_groups)

    # ---------------------------------------------------------------- steps
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(Step(scheduler_output))
        return self._gather(StepDone, None, starting=False)[0].output

    def check_health(self) -> None:
        """Raise WorkerDiedError if a local rank has exited (the core calls this when idle)."""
        for rank, process in self.processes.items():
            if not process.is_alive():
                self._rank_died(rank, starting=False)

    def _broadcast(self, message) -> None:
        unreachable = self._send_all(message)
        if unreachable:
            self.check_health()  # a dead local rank: say which and how it died
            self._fail(f"tensor-parallel rank {unreachable[0]} is not connected",
                       starting=isinstance(message, InitKVCache))

    def _send_all(self, message) -> list[int]:
        """Send `message` to every rank (encoded once); the ranks it could not reach."""
        data = self._codec.encode(message)
        unreachable = []
        for rank in range(self.size):
            try:
                self._router.send_multipart([rank_identity(rank), data], copy=False)
            except zmq.ZMQError:  # ROUTER_MANDATORY: that rank is not connected
                unreachable.append(rank)
        return unreachable

    def _gather(self, kind: type, timeout_s: float | None, starting: bool) -> list:
        """One `kind` message per rank (StepDone: rank 0's only), in rank order."""
        expected = 1 if kind is StepDone else self.size
        got: dict[int, object] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        sentinels = {p.sentinel: rank for rank, p in self.processes.items()}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        while len(got) < expected:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(poller.poll(wait_ms))
            if not events:
                self._fail(f"worker ranks did not start within {timeout_s:.0f} s "
                           f"({len(got)} of {expected} ready)", starting)
            # Messages first: a rank that failed said why before it exited.
            while self._router.poll(0):
                message = self._receive(starting)
                if isinstance(message, kind):
                    got[getattr(message, "rank", 0)] = message
            for fd, rank in sentinels.items():
                if fd in events:
                    self._rank_died(rank, starting)
            if self._monitor in events:
                self._monitor.recv_multipart()
                self._remote_disconnected(sentinels, starting)
        return [got[rank] for rank in sorted(got)]

    def _receive(self, starting: bool):
        """The next message from a rank; a WorkerFailed ends the engine (or its start)."""
        _, data = self._router.recv_multipart(copy=False)
        message = self._codec.decode(data.buffer)
        if isinstance(message, WorkerFailed):
            logger.debug("rank %d traceback:\n%s", message.rank, message.traceback)
            # A rank whose peer was killed fails in its next collective: name the dead
            # peer (and its signal), the cause, rather than the symptom.
            others = {p.sentinel: rank for rank, p in self.processes.items()
                      if rank != message.rank}
            for fd in multiprocessing.connection.wait(list(others), timeout=0.5):
                logger.error("tensor-parallel rank %d: %s", message.rank, message.message)
                self._rank_died(others[fd], starting)
            verb = "failed to start" if starting else "failed"
            self._fail(f"tensor-parallel rank {message.rank} {verb}: {message.message}",
                       starting)
        return message

    def _rank_died(self, rank: int, starting: bool) -> None:
        process = self.processes[rank]
        process.join(timeout=1)
        while self._router.poll(0):  # its own last word, if it had time to send one
            self._receive(starting)
        self._fail(f"tensor-parallel rank {rank} (pid {process.pid}) died: "
                   f"{describe_exit(process.exitcode)}", starting)

    def _remote_disconnected(self, sentinels: dict[int, int], starting: bool) -> None:
        # A local rank's death also drops its connection: give its sentinel a moment
        # so the report names the rank and the signal.
        ready = multiprocessing.connection.wait(list(sentinels), timeout=1.0)
        for fd in ready:
            self._rank_died(sentinels[fd], starting)
        self._fail("a worker rank's connection to the engine core closed (a rank on another "
                   "node exited or its node is unreachable)", starting)

    def _fail(self, message: str, starting: bool) -> None:
        logger.error("%s", message)
        if starting:
            raise RuntimeError(message)
        raise WorkerDiedError(message)

    # ---------------------------------------------------------------- shutdown
    def shutdown(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every local rank (Stop, then SIGKILL after `grace_s`); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._context is not None:
            self._send_all(Stop())
        stop_processes(self.processes, grace_s)
        if self._context is not None:
            with contextlib.suppress(Exception):
                self._router.disable_monitor()
            self._monitor.close(linger=0)
            self._router.close(linger=0)
            self._context.term()
            self._context = None
