"""EngineCore in its own process (or a background thread): the busy loop.

    frontend                      core process
    --------                      ------------
    PUSH input.sock  ──────────▶  input thread: decode ─▶ input_queue
                                  main thread:  busy loop
                                     idle?  block on input_queue
                                     else   drain input_queue (Ping -> Pong), step(),
                                            encode + send the outputs
    PULL output.sock ◀──────────  (OutputSockets: sends never block)

The model step runs in the main thread, and so does the send of its outputs, the moment
the step ends (~20 us; zmq's own I/O thread writes them): the frontend wakes while this
thread runs the next step's Python, with a core to spare. (A sending thread got the GIL
only when the next step's forward released it, so the frontend's work per token landed
beside the kernels' two threads: one client's ITL p50 ~7% longer, docs/performance.md.)
Decoding inputs happens in the input thread (zmq releases the GIL while it waits), so a
long step never keeps a message waiting in the socket. The process exits when the
frontend sends Shutdown, when its parent process is gone, or after sending EngineDead.

A core shared by N frontends (`serve --api-server-count N`) runs the same loop:
engine/core/shared_core.py.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.core.core import EngineCore
from engine.core.cpu_turns import CpuTurns, join_cpu_turns, turn_of
from engine.executor.abstract import ExecutorSpec
from engine.ipc import (
    UTILITY_METHODS,
    AbortRequests,
    AddRequest,
    CoreMessage,
    EngineDead,
    FrontendMessage,
    GrammarCheck,
    Outputs,
    Ping,
    Pong,
    Ready,
    Shutdown,
    StartupError,
    UtilityCall,
    UtilityResult,
    XrayCall,
    XrayResult,
    core_codec,
)
from engine.outputs import EngineCoreOutput, EngineCoreOutputs
from engine.structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5
_EMPTY_STEP_WAIT_S = 0.005
# The core runs at the default CPU priority (PAGEDSERVE_CORE_NICE=N lowers it). It
# once ran at nice +5 to keep /health fast during long prefills; but then any other
# busy process on the machine -- a client, a sidecar, a test -- starved the compute
# thread sharing its core, and since every parallel region waits for its slowest
# thread, a greedy request ran many times slower (docs/performance.md). The core's
# threads follow the CPUs it may use (`configure_compute_threads`) and sleep at
# barriers (OpenMP's wait settings, chosen by engine/openmp.py before the core starts).


def configure_compute_threads(requested: int | None = None) -> int:
    """One torch compute thread per CPU this process may use (affinity, cgroup quota),
    or `requested` (--cpu-threads); returns the count. More threads than CPUs would
    have every parallel region wait for a thread that is not running."""
    import torch

    from engine import cpu_info

    num_threads = requested or cpu_info.cpu_budget().num_threads
    torch.set_num_threads(num_threads)
    logger.info("compute threads: %d (%s)", num_threads,
                "--cpu-threads" if requested else cpu_info.describe())
    return num_threads


def build_engine_core(config: EngineConfig, executor_spec: ExecutorSpec | None) -> EngineCore:
    executor = executor_spec.build(config) if executor_spec is not None else None
    return EngineCore(config, executor)


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, transformers, the model's modules:
    ~200k tracked objects) out of the garbage collector's reach, as vLLM's core does.
    Otherwise each full collection walks them all and holds that step for a long stall
    (benchmarks.engine_overhead at 256 decodes; the figures: docs/performance.md). The
    process exits with os._exit, so nothing is unfrozen."""
    gc.collect()
    gc.freeze()


class EngineCoreProc:
    """Runs an EngineCore from an input queue; hands every message out via `send`.

    `send` is called from the loop's thread; it must not block for long.
    """

    def __init__(self, core: EngineCore, send: Callable[[CoreMessage], None],
                 cpu_turns: CpuTurns | None = None):
        self.core = core
        # SimpleQueue (C): a Queue's put costs ~20 us of Python at one client's step rate.
        self.input_queue: queue.SimpleQueue[FrontendMessage] = queue.SimpleQueue()
        self._send = send
        self._running = True
        # --cpu-turns: each step holds this host's CPUs against the group's other servers.
        self.cpu_turns = cpu_turns

    def run_busy_loop(self) -> None:
        """Loop until Shutdown. Raises if a step fails beyond one request's error."""
        idle_reported = True
        while self._running:
            if not self.core.has_unfinished_requests():
                if not idle_reported:
                    # Going idle (e.g. the last request was aborted, which makes no
                    # output): an empty step tells the runner which requests finished
                    # and sends fresh stats, so gauges do not keep stale values.
                    self._send(Outputs(self.core.step()))
                    idle_reported = True
                self._handle(self.input_queue.get())  # idle: sleep on the queue
            self._drain_input()
            if self._running and self.core.has_unfinished_requests():
                idle_reported = False
                self._step()

    def _drain_input(self) -> None:
        # The loop is the queue's only reader: not empty means get_nowait has a message.
        while self._running and not self.input_queue.empty():
            self._handle(self.input_queue.get_nowait())

    def _step(self) -> None:
        steps_before = (self.core.num_steps, self.core.num_steps_applied)
        with turn_of(self.cpu_turns):
            outputs = self.core.step()
        if self.cpu_turns is not None and outputs.scheduler_stats is not None:
            outputs.scheduler_stats.cpu_turns_wait_seconds = self.cpu_turns.take_waited_s()
        if outputs.outputs or (self.core.num_steps, self.core.num_steps_applied) != steps_before:
            self._send(Outputs(outputs))
            return
        # Work exists but nothing could be scheduled: wait a little for input instead
        # of spinning (e.g. everything waiting on KV blocks held by aborted requests).
        try:
            self._handle(self.input_queue.get(timeout=_EMPTY_STEP_WAIT_S))
        except queue.Empty:
            pass

    def _handle(self, message: FrontendMessage) -> None:
        if isinstance(message, AddRequest):
            request = message.request
            try:
                self.core.add_request(request)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                logger.warning("rejected request %s: %s", request.req_id, exc)
                failed = EngineCoreOutput(request.req_id, [], "error", error=str(exc))
                self._send(Outputs(EngineCoreOutputs(outputs=[failed], timestamp=time.time())))
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.req_ids)
        elif isinstance(message, Ping):
            # An idle engine learns of a dead worker rank here, not only at its next step
            # (the multiprocess executor raises WorkerDiedError, which ends the loop).
            check_health = getattr(self.core.executor, "check_health", None)
            if check_health is not None:
                check_health()
            self._send(Pong(message.ping_id))  # between two steps: the loop is alive
        elif isinstance(message, UtilityCall):
            self._send(self._call_utility(message))
        elif isinstance(message, GrammarCheck):
            self._check_grammar(message)
        elif isinstance(message, XrayCall):
            self._send(self._xray_snapshot(message))
        elif isinstance(message, Shutdown):
            self._running = False
        else:  # pragma: no cover - the codec only decodes the union above
            raise TypeError(f"unexpected message {type(message).__name__}")

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in UTILITY_METHODS:
            return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            return UtilityResult(call.call_id, result=getattr(self.core, call.method)())
        except Exception as exc:  # noqa: BLE001
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")


    def _check_grammar(self, check: GrammarCheck) -> None:
        reply = self._reply_to_sender()

        def on_done(error: str | None) -> None:  # on a grammar thread
            reply(UtilityResult(check.call_id, error=error))

        self.core.check_grammar(StructuredOutputsParams(check.kind, check.spec), on_done)

    def _reply_to_sender(self) -> Callable[[CoreMessage], None]:
        """How to answer the message being handled later, from another thread."""
        return self._send

    def _xray_snapshot(self, call: XrayCall) -> XrayResult:
        try:
            return XrayResult(call.call_id, snapshot=self.core.xray_snapshot(call.limits))
        except Exception as exc:  # noqa: BLE001 - a viewer's bug must not stop serving
            logger.exception("x-ray snapshot failed")
            return XrayResult(call.call_id, error=f"{type(exc).__name__}: {exc}")


def _watch_parent(parent_pid: int) -> None:
    """Exit hard when the frontend process is gone (we were re-parented)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(_PARENT_POLL_S)


def prepare_core_process(config: EngineConfig, parent_pid: int, log_level: str) -> None:
    """Signals, priority, logging, the parent watch, CPUs: before any socket or thread."""
    # The frontend decides when we stop (it drains requests first, then sends Shutdown);
    # a Ctrl-C or SIGTERM sent to the whole process group must not kill us mid-drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    niceness = int(os.environ.get("PAGEDSERVE_CORE_NICE", "0"))
    if niceness:
        with contextlib.suppress(OSError):  # before any thread starts: they inherit it
            os.nice(niceness)
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s %(levelname)s [engine-core pid={os.getpid()}] %(name)s: %(message)s",
    )
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="parent-watch").start()
    if config.device_config.cpu_layout == "split":
        from engine import cpu_info

        cpu_info.pin_this_process(cpu_info.split_cpus(cpu_info.cpu_budget().affinity)[1])
    configure_compute_threads(config.device_config.cpu_threads)


class OutputSockets:
    """The core's PUSH sockets to its frontend(s), each connected with no send limit
    (ZMQ_SNDHWM 0), so a send never blocks: a frontend that reads slowly finds the
    messages queued, as they did in the output queue a sending thread once drained.

    `send` encodes and queues one message for frontend `to` (None: every frontend). The
    busy loop calls it; so may a grammar thread answering a GrammarCheck: one lock around
    the codec and the sockets (a ZMQ socket is not thread-safe)."""

    def __init__(self, context: Any, addresses: list[str]):
        import zmq

        self.sockets = []
        for address in addresses:  # connect: queued until the frontend binds
            socket = context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)  # before connect: it sizes the new pipe
            socket.connect(address)
            self.sockets.append(socket)
        self._codec = core_codec()
        self._lock = threading.Lock()

    def send(self, message: CoreMessage, to: int | None = None) -> None:
        with self._lock:
            data = self._codec.encode(message)
            for socket in self.sockets if to is None else (self.sockets[to],):
                socket.send(data, copy=False)

    def close(self, linger_ms: int) -> None:
        """Close every socket; what is still queued is sent for up to `linger_ms`."""
        for socket in self.sockets:
            socket.close(linger=linger_ms)


def run_until_stopped(proc: EngineCoreProc, outputs: OutputSockets) -> int:
    """Run the busy loop until Shutdown (exit code 0) or a fatal error (1: EngineDead is
    sent to every frontend first); then shut the executor down."""
    exit_code = 0
    try:
        proc.run_busy_loop()
    except BaseException as exc:  # noqa: BLE001 - tell the frontends before dying
        logger.exception("engine core died")
        outputs.send(EngineDead(f"{type(exc).__name__}: {exc}"))
        exit_code = 1
    try:
        proc.core.shutdown()
    except Exception:  # noqa: BLE001
        logger.exception("executor shutdown failed")
    return exit_code


def run_engine_core(
    config: EngineConfig,
    executor_spec: ExecutorSpec | None,
    input_address: str,
    output_address: str,
    parent_pid: int,
    log_level: str = "INFO",
) -> None:
    """Entry point of the core process (start method: spawn).

    Sends Ready or StartupError first, then Outputs per step. Exit code 0 after
    Shutdown, 1 after a start-up failure or a fatal error (EngineDead is sent first).
    """
    import zmq

    prepare_core_process(config, parent_pid, log_level)
    context = zmq.Context()
    outputs = OutputSockets(context, [output_address])
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)

    try:
        core = build_engine_core(config, executor_spec)
    except BaseException as exc:  # noqa: BLE001 - report every start-up failure
        logger.error("engine core failed to start: %s", exc)
        message = f"{type(exc).__name__}: {exc}"
        outputs.send(StartupError(message, traceback.format_exc()))
        input_socket.close(linger=0)
        outputs.close(5000)
        context.term()  # returns once StartupError is delivered (or the linger ran out)
        os._exit(1)
    freeze_startup_heap()

    proc = EngineCoreProc(core, outputs.send, join_cpu_turns(config))

    def receive_inputs() -> None:
        in_codec = core_codec()
        while True:
            try:
                data = input_socket.recv(copy=False)
            except zmq.ContextTerminated:
                input_socket.close(linger=0)
                return
            proc.input_queue.put(in_codec.decode(data.buffer))

    threading.Thread(target=receive_inputs, daemon=True, name="core-input").start()
    outputs.send(Ready(core.kv_cache_info, os.getpid()))
    logger.info("engine core ready: %s", core.kv_cache_info)

    exit_code = run_until_stopped(proc, outputs)
    outputs.close(2000)
    context.term()  # unblocks the input thread, which closes its socket; flushes output
    os._exit(exit_code)
