"""The front ends' side of an engine core shared by N API servers (`--api-server-count N`).

    SharedCoreProcess      the launcher's handle: spawns the shared core, stops it
    AsyncSharedCoreClient  frontend k's client: its own requests' outputs, its own replies

The core's side is engine/core/shared_core.py; the launcher is server/http/launcher.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.core.shared_core import run_shared_engine_core
from engine.executor.abstract import ExecutorSpec
from engine.frontend.core_client import (
    DEFAULT_STARTUP_TIMEOUT_S,
    EngineDeadError,
    EngineStartupError,
    SocketClient,
    end_process,
    spawn_core_process,
)
from engine.ipc import (
    LAUNCHER_IDENTITY,
    SharedCoreAddresses,
    SharedCoreLink,
    Shutdown,
    frontend_codec,
    frontend_identity,
)


class SharedCoreProcess:
    """The launcher's handle on an engine core shared by `num_frontends` frontends.

    Spawns `run_shared_engine_core` with its sockets in a fresh temporary directory; the
    frontends join it with `link(k)` (AsyncSharedCoreClient). Only `close()` (the
    launcher's Shutdown, over its own DEALER) stops the core; it exits by itself too
    when the launcher process is gone.
    """

    def __init__(self, config: EngineConfig, executor_spec: ExecutorSpec | None,
                 num_frontends: int, log_level: str):
        self.ipc_dir = tempfile.mkdtemp(prefix="pagedserve-")
        self.addresses = SharedCoreAddresses.in_dir(self.ipc_dir, num_frontends)
        self.process = spawn_core_process(
            run_shared_engine_core,
            (config, executor_spec, self.addresses, os.getpid(), log_level))
        self._closed = False

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def link(self, client_index: int) -> SharedCoreLink:
        return SharedCoreLink(self.addresses, client_index, self.pid)

    def close(self) -> None:
        """Send Shutdown, wait for the core (terminate/kill if needed), clean up."""
        if self._closed:
            return
        self._closed = True
        if self.process.is_alive():
            context = zmq.Context()
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.ROUTING_ID, LAUNCHER_IDENTITY)
            socket.connect(self.addresses.input_address)
            with contextlib.suppress(zmq.ZMQError):
                socket.send(frontend_codec().encode(Shutdown()), flags=zmq.NOBLOCK)
            self.process.join(timeout=10)
            socket.close(linger=0)
            context.term()
        end_process(self.process)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (gone, or a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
        return state in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


class AsyncSharedCoreClient(SocketClient):
    """Frontend k of several sharing one engine core (started by the launcher).

    A DEALER (routing id `frontend_identity(k)`) to the core's ROUTER, a PULL bound at
    the core's output address for k: the core sends here only this frontend's outputs
    and the answers to its own calls (engine/core/shared_core.py, SharedEngineCoreProc). The core
    is not this process's child: `check_alive` looks at its pid. `shutdown()` only
    leaves (the launcher stops the core once every frontend has stopped).
    """

    shares_core = True

    def __init__(self, link: SharedCoreLink):
        super().__init__()
        self.link = link
        self._codec = frontend_codec()
        self._context = zmq.asyncio.Context()
        self._input = self._context.socket(zmq.DEALER)
        self._input.setsockopt(zmq.ROUTING_ID, frontend_identity(link.client_index))
        self._input.connect(link.addresses.input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(link.addresses.output_addresses[link.client_index])
        self._closed = False

    @classmethod
    async def start(cls, link: SharedCoreLink,
                    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> AsyncSharedCoreClient:
        """Join the core and wait for its Ready (or raise EngineStartupError)."""
        def gone() -> EngineStartupError | None:
            if _process_gone(link.core_pid):
                return EngineStartupError("the engine core process exited during start-up")
            return None

        client = cls(link)
        await client._wait_until_ready(startup_timeout_s, gone)
        return client

    @property
    def pid(self) -> int:
        return self.link.core_pid

    def check_alive(self) -> None:
        if _process_gone(self.link.core_pid):
            raise EngineDeadError(
                f"the engine core process (pid {self.link.core_pid}) exited unexpectedly")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._input.close(linger=1000)  # the last aborts still reach the core
        self._output.close(linger=0)
        self._context.term()
