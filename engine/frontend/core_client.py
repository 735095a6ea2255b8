"""The frontend's handle on the engine core: in-process, background thread, or process.

    AsyncMPClient      asyncio; the core runs in its own process (the server's default)
    AsyncThreadClient  asyncio; the core's busy loop runs in a background thread (tests)

Frontend k of N sharing one core process (`serve --api-server-count N`) is
AsyncSharedCoreClient, in engine/frontend/shared_core_client.py.

Every client delivers the core's `EngineCoreOutputs` in step order. The process
clients raise `EngineStartupError` (with the core's own message) when the core cannot
start, and `EngineDeadError` from `get_output*` once the core process is gone (the
async process client notices a dead process within `_DEATH_POLL_MS`).

Liveness: `ping_async()` sends a Ping that the core's busy loop answers between two
steps; `last_message_time` is when the core last said anything (a step's outputs, a
Pong), so a caller can tell "busy with a long step" from "stuck".
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Literal

import zmq
import zmq.asyncio

from engine import openmp
from engine.config import EngineConfig
from engine.core.core import EngineCore
from engine.core.core_proc import (
    EngineCoreProc,
    build_engine_core,
    run_engine_core,
)
from engine.core.cpu_turns import join_cpu_turns
from engine.executor.abstract import Executor, ExecutorSpec
from engine.ipc import (
    AbortRequests,
    AddRequest,
    Codec,
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
    frontend_codec,
)
from engine.outputs import EngineCoreOutputs, KVCacheInfo
from engine.request import EngineCoreRequest
from engine.structured_output import StructuredOutputsParams
from engine.xray_schema import XrayLimits, XraySnapshot

logger = logging.getLogger(__name__)

_POLL_MS = 1000
# How often the async process client checks that the core process still exists while
# it waits for output: a killed core is noticed (and its requests failed) this fast.
_DEATH_POLL_MS = 100
DEFAULT_STARTUP_TIMEOUT_S = 1800.0


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message is the core's own one-liner."""


class EngineDeadError(RuntimeError):
    """The engine core stopped working; no request can be served any more."""


def core_openmp_env(config: EngineConfig) -> dict[str, str | None]:
    """Changes to the environment the engine-core child starts with (None: unset there),
    read when its torch loads: engine/openmp.py's choice for the model's kind."""
    from engine.model_loader.pooling_config import is_torch_encoder

    return openmp.child_env(encoder=is_torch_encoder(config.model_config.model))


def spawn_core_process(target, args: tuple) -> multiprocessing.process.BaseProcess:
    """Start the engine-core process (start method: spawn) running `target(*args)`, where
    args[0] is its EngineConfig, with `core_openmp_env`'s settings in its environment."""
    spawn = multiprocessing.get_context("spawn")
    changes = core_openmp_env(args[0])
    saved = {name: os.environ.get(name) for name in changes}
    process = spawn.Process(target=target, args=args, name="EngineCore")
    _set_environment(changes)  # spawn copies the environment at start()
    try:
        process.start()
    finally:
        _set_environment(saved)
    return process


def _set_environment(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _pin_frontend(config: EngineConfig) -> None:
    if config.device_config.cpu_layout == "split":
        # The core inherited every CPU and takes its share itself; the frontend
        # keeps the first one (engine.cpu_info.split_cpus).
        from engine import cpu_info

        cpu_info.pin_this_process(cpu_info.split_cpus(cpu_info.cpu_budget().affinity)[0])


class _CoreProcess:
    """Spawns the core process and owns the frontend's two sockets to it.

    The sockets' context type (plain or asyncio) is the caller's choice.
    """

    def __init__(
        self,
        context: zmq.Context,
        config: EngineConfig,
        executor_spec: ExecutorSpec | None,
        log_level: str,
    ):
        self.context = context
        self.ipc_dir = tempfile.mkdtemp(prefix="pagedserve-")
        input_address = f"ipc://{self.ipc_dir}/input.sock"
        output_address = f"ipc://{self.ipc_dir}/output.sock"
        self.input_socket = context.socket(zmq.PUSH)
        self.input_socket.bind(input_address)
        self.output_socket = context.socket(zmq.PULL)
        self.output_socket.bind(output_address)
        self.process = spawn_core_process(
            run_engine_core,
            (config, executor_spec, input_address, output_address, os.getpid(), log_level))
        _pin_frontend(config)
        self._closed = False

    def check_alive(self) -> None:
        if not self.process.is_alive():
            raise EngineDeadError(describe_exit(self.process.exitcode))

    @staticmethod
    def handle_startup_message(message: CoreMessage) -> KVCacheInfo:
        if isinstance(message, Ready):
            return message.kv_cache_info
        if isinstance(message, StartupError):
            logger.debug("engine core start-up traceback:\n%s", message.traceback)
            raise EngineStartupError(message.message)
        raise EngineStartupError(f"unexpected first message from the engine core: {message!r}")

    def startup_failed(self) -> EngineStartupError:
        self.process.join(timeout=5)
        return EngineStartupError(
            f"the engine core process exited during start-up (exit code {self.process.exitcode})"
        )

    def close(self) -> None:
        """Ask the core to stop, wait for it (terminate/kill if needed), clean up."""
        if self._closed:
            return
        self._closed = True
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                # A plain (non-asyncio) send works outside a running loop too; a PUSH
                # socket with room in its queue completes at once.
                zmq.Socket.send(self.input_socket, frontend_codec().encode(Shutdown()),
                                flags=zmq.NOBLOCK)
            self.process.join(timeout=10)
        end_process(self.process)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.context.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def end_process(process) -> None:
    """A core that did not stop when asked: terminate it, then kill it."""
    if process.is_alive():
        logger.warning("engine core did not stop; terminating it")
        process.terminate()
        process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)


def describe_exit(exitcode: int | None) -> str:
    """'the engine core process exited unexpectedly (killed by signal 9, SIGKILL)'..."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return (f"the engine core process exited unexpectedly (killed by signal {-exitcode}, "
                f"{name})")
    return f"the engine core process exited unexpectedly (exit code {exitcode})"


def _utility_value(result: UtilityResult):
    if result.error is not None:
        raise RuntimeError(result.error)
    return result.result


# -------------------------------------------------------------------------- async
class AsyncEngineCoreClient(abc.ABC):
    """The asyncio face of the core. `get_output_async` has one caller at a time."""

    kv_cache_info: KVCacheInfo
    # Several frontends share the core: it may be busy with requests this frontend does
    # not know, and it sends this frontend every step (see SharedEngineCoreProc).
    shares_core = False

    def __init__(self) -> None:
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._ping_ids = itertools.count()
        self._ping: tuple[int, asyncio.Future] | None = None  # the one ping in flight
        # time.monotonic() of the core's latest message (outputs, pong, utility result).
        self.last_message_time = time.monotonic()

    @abc.abstractmethod
    async def _send(self, message: FrontendMessage) -> None: ...

    @abc.abstractmethod
    async def _next_message(self) -> CoreMessage: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    @abc.abstractmethod
    def check_alive(self) -> None:
        """Raise EngineDeadError if the core (process or thread) is gone."""

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(AddRequest(request))

    async def abort_requests_async(self, req_ids: list[str]) -> None:
        if req_ids:
            await self._send(AbortRequests(list(req_ids)))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs; raises EngineDeadError once the core is gone."""
        while True:
            try:
                message = await self._next_message()
            except EngineDeadError as exc:
                self._fail_pending_calls(str(exc))
                raise
            self.last_message_time = time.monotonic()
            if isinstance(message, Outputs):
                return message.outputs
            if isinstance(message, Pong):
                if self._ping is not None and self._ping[0] == message.ping_id:
                    if not self._ping[1].done():
                        self._ping[1].set_result(None)
                    self._ping = None
            elif isinstance(message, UtilityResult | XrayResult):
                future = self._pending_calls.pop(message.call_id, None)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, EngineDead):
                self._fail_pending_calls(message.message)
                raise EngineDeadError(message.message)
            else:
                raise EngineDeadError(f"unexpected message from the engine core: {message!r}")

    async def call_utility_async(self, method: str):
        """Call a core utility; needs a task consuming `get_output_async`."""
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        await self._send(UtilityCall(call_id, method))
        return _utility_value(await future)

    async def check_grammar_async(self, params: StructuredOutputsParams) -> str | None:
        """None if the core compiled `params`, else the grammar library's message; needs a
        task consuming `get_output_async`."""
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        await self._send(GrammarCheck(call_id, params.kind, params.spec))
        result: UtilityResult = await future
        return result.error

    async def xray_snapshot_async(self, limits: XrayLimits) -> XraySnapshot:
        """An engine x-ray snapshot, built by the core between two steps; needs a task
        consuming `get_output_async`. Raises RuntimeError if the core failed to build it."""
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        await self._send(XrayCall(call_id, limits))
        result: XrayResult = await future
        if result.error is not None or result.snapshot is None:
            raise RuntimeError(f"the engine core could not take an x-ray snapshot: {result.error}")
        return result.snapshot

    async def ping_async(self, timeout_s: float) -> bool:
        """True if the core's busy loop answers a Ping within `timeout_s`.

        Concurrent callers share one Ping in flight (a burst of probes is one message).
        Needs a task consuming `get_output_async`, which delivers the Pong.
        """
        if self._ping is None:
            ping_id = next(self._ping_ids)
            future = asyncio.get_running_loop().create_future()
            self._ping = (ping_id, future)
            try:
                await self._send(Ping(ping_id))
            except BaseException:
                self._ping = None
                raise
        future = self._ping[1] if self._ping is not None else None
        if future is None:  # answered while we were sending
            return True
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def _fail_pending_calls(self, message: str) -> None:
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(message))
        self._pending_calls.clear()
        if self._ping is not None:
            if not self._ping[1].done():
                self._ping[1].set_exception(EngineDeadError(message))
            self._ping[1].exception()  # retrieved: no "never retrieved" warning
            self._ping = None


class SocketClient(AsyncEngineCoreClient):
    """A core in another process, over ZMQ: messages go out on `_input`, come back on
    `_output`. Subclasses set both sockets and `_codec`, and say how the core's death
    shows (`check_alive`, and `gone` while it starts)."""

    _codec: Codec
    _input: zmq.asyncio.Socket
    _output: zmq.asyncio.Socket
    _plain_output: zmq.Socket | None = None  # _output without pyzmq's asyncio layer

    async def _wait_until_ready(self, startup_timeout_s: float,
                                gone: Callable[[], EngineStartupError | None]) -> None:
        """Wait for the core's first message (Ready: sets kv_cache_info). Raises
        EngineStartupError: the core's own, `gone()`'s when that is not None (the core
        exited), or a timeout. Shuts this client down before raising."""
        deadline = time.monotonic() + startup_timeout_s
        try:
            while not await self._output_ready(_POLL_MS / 1000):
                error = gone()
                if error is not None:
                    raise error
                if time.monotonic() > deadline:
                    raise EngineStartupError(
                        f"the engine core did not start within {startup_timeout_s:.0f} s")
            message = self._codec.decode(self._plain().recv(zmq.NOBLOCK))
            self.kv_cache_info = _CoreProcess.handle_startup_message(message)
        except BaseException:
            self.shutdown()
            raise

    async def _send(self, message: FrontendMessage) -> None:
        """Raises EngineDeadError if the core dies before it can take the message.

        A socket whose peer is gone blocks a send forever: wait for room in slices of
        _DEATH_POLL_MS and check the core between them.
        """
        data = self._codec.encode(message)
        while True:
            try:  # the usual case, with room: sent without yielding to the event loop
                await self._input.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                await self._input.poll(_DEATH_POLL_MS, zmq.POLLOUT)
                self.check_alive()

    async def _next_message(self) -> CoreMessage:
        while True:
            try:
                return self._codec.decode(self._plain().recv(zmq.NOBLOCK))
            except zmq.Again:
                pass
            if not await self._output_ready(_DEATH_POLL_MS / 1000):
                self.check_alive()

    def _plain(self) -> zmq.Socket:
        """`_output` for plain (non-asyncio) calls: the same socket."""
        if self._plain_output is None:
            self._plain_output = zmq.Socket.shadow(self._output.underlying)
        return self._plain_output

    async def _output_ready(self, timeout_s: float) -> bool:
        """Whether a message waits on `_output`, now or within `timeout_s`. Plain zmq calls
        and the event loop watching the socket's descriptor, not pyzmq's asyncio layer
        (its futures and callbacks cost the frontend ~9% of its CPU a token). ZMQ_FD only
        signals changes: ZMQ_EVENTS says whether a message is queued (and re-arms the
        descriptor), before the wait and after it."""
        plain = self._plain()
        if plain.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return True
        await _wait_readable(plain.getsockopt(zmq.FD), timeout_s)
        return bool(plain.getsockopt(zmq.EVENTS) & zmq.POLLIN)


async def _wait_readable(fd: int, timeout_s: float) -> None:
    """Return once `fd` is readable, or after `timeout_s`."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, settle)
    timer = loop.call_later(timeout_s, settle)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        timer.cancel()


class AsyncMPClient(SocketClient):
    """The core in its own (spawned) process, over ZMQ ipc:// sockets."""

    def __init__(self, config: EngineConfig, executor_spec: ExecutorSpec | None, log_level: str):
        super().__init__()
        self._codec = frontend_codec()
        self._proc = _CoreProcess(zmq.asyncio.Context(), config, executor_spec, log_level)
        self._input, self._output = self._proc.input_socket, self._proc.output_socket
        self._finalizer = weakref.finalize(self, self._proc.close)

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        executor_spec: ExecutorSpec | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        log_level: str = "INFO",
    ) -> AsyncMPClient:
        """Spawn the core and wait until it is ready (or raise EngineStartupError)."""
        client = cls(config, executor_spec, log_level)
        proc = client._proc
        await client._wait_until_ready(
            startup_timeout_s, lambda: None if proc.process.is_alive() else proc.startup_failed())
        return client

    @property
    def pid(self) -> int | None:
        return self._proc.process.pid

    def check_alive(self) -> None:
        self._proc.check_alive()

    def shutdown(self) -> None:
        self._finalizer()


class AsyncThreadClient(AsyncEngineCoreClient):
    """The core's busy loop in a daemon thread of this process (no IPC, no codec)."""

    def __init__(self, core: EngineCore, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.kv_cache_info = core.kv_cache_info
        self._outputs: asyncio.Queue[CoreMessage] = asyncio.Queue()

        def send(message: CoreMessage) -> None:
            loop.call_soon_threadsafe(self._outputs.put_nowait, message)

        self._proc = EngineCoreProc(core, send, join_cpu_turns(core.config))
        self._thread = threading.Thread(target=self._run, args=(send,), daemon=True,
                                        name="engine-core")
        self._thread.start()

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        executor_spec: ExecutorSpec | None = None,
        executor: Executor | None = None,
    ) -> AsyncThreadClient:
        if executor is not None:
            core = await asyncio.to_thread(EngineCore, config, executor)
        else:
            try:
                core = await asyncio.to_thread(build_engine_core, config, executor_spec)
            except Exception as exc:
                raise EngineStartupError(f"{type(exc).__name__}: {exc}") from exc
        return cls(core, asyncio.get_running_loop())

    def _run(self, send) -> None:
        try:
            self._proc.run_busy_loop()
        except BaseException as exc:  # noqa: BLE001
            logger.exception("engine core thread died")
            send(EngineDead(f"{type(exc).__name__}: {exc}"))
        finally:
            self._proc.core.shutdown()

    async def _send(self, message: FrontendMessage) -> None:
        self._proc.input_queue.put(message)

    async def _next_message(self) -> CoreMessage:
        return await self._outputs.get()

    def check_alive(self) -> None:
        if not self._thread.is_alive():
            raise EngineDeadError("the engine core thread stopped")

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._proc.input_queue.put(Shutdown())
            self._thread.join(timeout=10)


async def start_async_client(
    config: EngineConfig,
    executor_spec: ExecutorSpec | None = None,
    mode: Literal["process", "thread"] = "process",
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    log_level: str = "INFO",
) -> AsyncEngineCoreClient:
    """Start the engine core the way the server runs it ("process") or in a thread."""
    if mode == "process":
        return await AsyncMPClient.start(config, executor_spec, startup_timeout_s, log_level)
    return await AsyncThreadClient.start(config, executor_spec)
