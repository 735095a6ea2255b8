"""The engine core shared by N API servers (`serve --api-server-count N`).

The busy loop of engine/core/core_proc.py (`run_shared_engine_core`), with a ROUTER
input socket and one PUSH per frontend (engine/ipc.py), and `SharedEngineCoreProc`
routing every message:

    frontend 0 ─┐                     ┌─ FromFrontend(k, msg) ─▶ input_queue ─▶ busy loop
    frontend 1 ─┼─▶ ROUTER input.sock ┘                                            │
    launcher  ──┘     (Shutdown only)         step outputs split by request owner ◀┘
                                              replies (Pong, ...) to the asker
    frontend k ◀── PUSH output-k.sock ◀── OutputSockets.send(msg, k), by the busy loop

Its parent is the launcher (server/http/launcher.py), which alone sends Shutdown. The
frontends' side is engine/frontend/shared_core_client.py; the sockets' addresses and
identities are in engine/ipc.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.core import EngineCore
from engine.core.core_proc import (
    EngineCoreProc,
    OutputSockets,
    build_engine_core,
    freeze_startup_heap,
    prepare_core_process,
    run_until_stopped,
)
from engine.core.cpu_turns import CpuTurns, join_cpu_turns
from engine.executor.abstract import ExecutorSpec
from engine.ipc import (
    AbortRequests,
    AddRequest,
    CoreMessage,
    FrontendMessage,
    Outputs,
    Ready,
    SharedCoreAddresses,
    Shutdown,
    StartupError,
    core_codec,
    frontend_index,
)
from engine.outputs import EngineCoreOutput, EngineCoreOutputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FromFrontend:
    """An item of a shared core's input queue: a message and who sent it
    (`client_index` k: frontend k; None: the launcher)."""

    client_index: int | None
    message: FrontendMessage


# The frontend that receives every step's SchedulerStats: the engine-wide metrics
# (gauges, token counters, step histograms) are recorded by this one frontend only, so
# the launcher's multiprocess /metrics counts each step once.
STATS_FRONTEND = 0


class SharedEngineCoreProc(EngineCoreProc):
    """EngineCoreProc for one core shared by several frontends.

    Input items are `FromFrontend`; everything goes out through `send_to(message, k)`
    (engine/core/core_proc.py, OutputSockets.send; k None: every frontend):
      * a step's EngineCoreOutputs are split by the owner of each request: frontend k
        gets only its own requests' outputs and first-scheduled times; the step's
        SchedulerStats go to STATS_FRONTEND only. Every frontend gets its part of every
        step, empty or not: that is how a frontend with no request of its own knows
        the core is busy with a long step rather than stuck (AsyncEngine.check_health);
      * Pong, UtilityResult and XrayResult go to the frontend that asked (also a
        GrammarCheck's UtilityResult, sent later from a grammar thread);
      * Ready, StartupError and EngineDead go to every frontend (run_shared_engine_core).
    A request id belongs to the frontend that added it until its last output (finished)
    or until that frontend aborts it. An id in use (by any frontend) is refused with an
    "error" output to the sender only; an abort from frontend k ignores ids that are not
    k's. Only the launcher's Shutdown stops the loop (a frontend that stops just leaves).
    """

    def __init__(self, core: EngineCore, send_to: Callable[[CoreMessage, int | None], None],
                 num_frontends: int, cpu_turns: CpuTurns | None = None):
        super().__init__(core, self._route, cpu_turns)
        self._send_to = send_to
        self.num_frontends = num_frontends
        self.owners: dict[str, int] = {}  # req_id -> index of the frontend that added it
        self._asker: int | None = None  # the sender of the message being handled

    def _handle(self, item: FromFrontend) -> None:  # type: ignore[override]
        sender, message = item.client_index, item.message
        if sender is None:  # the launcher
            if isinstance(message, Shutdown):
                super()._handle(message)
            else:
                logger.warning("ignored %s from the launcher", type(message).__name__)
            return
        if isinstance(message, Shutdown):
            logger.warning("ignored Shutdown from frontend %d (the launcher stops the core)",
                           sender)
            return
        if isinstance(message, AddRequest):
            req_id = message.request.req_id
            if req_id in self.owners:
                failed = EngineCoreOutput(req_id, [], "error",
                                          error=f"request id {req_id!r} is already in use")
                self._send_to(Outputs(EngineCoreOutputs(outputs=[failed],
                                                        timestamp=time.time())), sender)
                return
            self.owners[req_id] = sender  # before the core runs it: a refusal is routed too
        elif isinstance(message, AbortRequests):
            mine = [req_id for req_id in message.req_ids if self.owners.get(req_id) == sender]
            for req_id in mine:
                del self.owners[req_id]
            message = AbortRequests(mine)
        self._asker = sender
        try:
            super()._handle(message)
        finally:
            self._asker = None

    def _reply_to_sender(self) -> Callable[[CoreMessage], None]:
        sender = self._asker
        return lambda message: self._send_to(message, sender)

    def _route(self, message: CoreMessage) -> None:
        if isinstance(message, Outputs):
            self._split(message.outputs)
        else:  # a reply, to the asker (every reply is sent while its message is handled)
            self._send_to(message, self._asker)

    def _split(self, outputs: EngineCoreOutputs) -> None:
        parts = [EngineCoreOutputs(timestamp=outputs.timestamp)
                 for _ in range(self.num_frontends)]
        for req_id, scheduled_time in outputs.scheduled_times.items():
            owner = self.owners.get(req_id)
            if owner is not None:
                parts[owner].scheduled_times[req_id] = scheduled_time
        for output in outputs.outputs:
            owner = self.owners.get(output.req_id)
            if owner is None:
                continue  # aborted by its frontend meanwhile: nobody wants it
            parts[owner].outputs.append(output)
            if output.finished:
                del self.owners[output.req_id]
        parts[STATS_FRONTEND].scheduler_stats = outputs.scheduler_stats
        for k, part in enumerate(parts):
            self._send_to(Outputs(part), k)


def run_shared_engine_core(
    config: EngineConfig,
    executor_spec: ExecutorSpec | None,
    addresses: SharedCoreAddresses,
    parent_pid: int,
    log_level: str = "INFO",
) -> None:
    """Entry point of a core shared by several frontends (start method: spawn; the
    parent is the launcher). As `run_engine_core`, over the sockets of `addresses`:
    Ready / StartupError / EngineDead go to every frontend, the rest is routed by
    `SharedEngineCoreProc`."""
    import zmq

    prepare_core_process(config, parent_pid, log_level)
    context = zmq.Context()
    input_socket = context.socket(zmq.ROUTER)
    input_socket.bind(addresses.input_address)
    outputs = OutputSockets(context, list(addresses.output_addresses))

    try:
        core = build_engine_core(config, executor_spec)
    except BaseException as exc:  # noqa: BLE001 - report every start-up failure
        logger.error("engine core failed to start: %s", exc)
        outputs.send(StartupError(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        input_socket.close(linger=0)
        outputs.close(5000)
        context.term()
        os._exit(1)
    freeze_startup_heap()

    proc = SharedEngineCoreProc(core, outputs.send, len(outputs.sockets),
                                join_cpu_turns(config))

    def receive_inputs() -> None:
        in_codec = core_codec()
        while True:
            try:
                identity, data = input_socket.recv_multipart(copy=False)
            except zmq.ContextTerminated:
                input_socket.close(linger=0)
                return
            message = in_codec.decode(data.buffer)
            proc.input_queue.put(FromFrontend(frontend_index(identity.bytes), message))

    threading.Thread(target=receive_inputs, daemon=True, name="core-input").start()
    outputs.send(Ready(core.kv_cache_info, os.getpid()))  # to every frontend
    logger.info("engine core ready for %d frontends: %s", len(outputs.sockets),
                core.kv_cache_info)

    exit_code = run_until_stopped(proc, outputs)
    # After Shutdown every frontend has left: nothing queued for them is wanted.
    outputs.close(2000 if exit_code else 0)
    context.term()
    os._exit(exit_code)
