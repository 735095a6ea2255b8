"""Blocking engine-core clients, for tests that drive the core step by step.

    InprocClient  the core in the caller's thread: `get_output()` is one `step()`
    SyncMPClient  the core in its own process (the server's machinery), blocking calls

The server uses the asyncio clients of engine/frontend/core_client.py and the offline
LLM drives its EngineCore itself; these exercise the same core and process code.
"""

from __future__ import annotations

import abc
import itertools
import time
import weakref

import zmq

from engine.config import EngineConfig
from engine.core.core import EngineCore
from engine.executor.abstract import Executor, ExecutorSpec
from engine.frontend.core_client import (
    _DEATH_POLL_MS,
    _POLL_MS,
    DEFAULT_STARTUP_TIMEOUT_S,
    EngineDeadError,
    EngineStartupError,
    _CoreProcess,
    _utility_value,
)
from engine.ipc import (
    AbortRequests,
    AddRequest,
    CoreMessage,
    EngineDead,
    FrontendMessage,
    Outputs,
    UtilityCall,
    UtilityResult,
    frontend_codec,
)
from engine.outputs import EngineCoreOutputs, KVCacheInfo
from engine.request import EngineCoreRequest


class EngineCoreClient(abc.ABC):
    kv_cache_info: KVCacheInfo

    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, req_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (blocks until there are some)."""

    @abc.abstractmethod
    def call_utility(self, method: str): ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The core in the caller's thread: `get_output()` is one `step()`."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.kv_cache_info = core.kv_cache_info

    @classmethod
    def start(cls, config: EngineConfig, executor: Executor | None = None) -> InprocClient:
        return cls(EngineCore(config, executor))

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> None:
        self.core.abort_requests(req_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def call_utility(self, method: str):
        return getattr(self.core, method)()

    def shutdown(self) -> None:
        self.core.shutdown()


class SyncMPClient(EngineCoreClient):
    """The core in its own process; blocking calls."""

    def __init__(
        self,
        config: EngineConfig,
        executor_spec: ExecutorSpec | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        log_level: str = "INFO",
    ):
        self._codec = frontend_codec()
        self._proc = _CoreProcess(zmq.Context(), config, executor_spec, log_level)
        self._finalizer = weakref.finalize(self, self._proc.close)
        self._call_ids = itertools.count()
        self._utility_results: dict[int, UtilityResult] = {}
        deadline = time.monotonic() + startup_timeout_s
        try:
            while not self._proc.output_socket.poll(_POLL_MS):
                if not self._proc.process.is_alive():
                    raise self._proc.startup_failed()
                if time.monotonic() > deadline:
                    raise EngineStartupError(
                        f"the engine core did not start within {startup_timeout_s:.0f} s")
            message = self._codec.decode(self._proc.output_socket.recv())
            self.kv_cache_info = self._proc.handle_startup_message(message)
        except BaseException:
            self.shutdown()
            raise

    def _send(self, message: FrontendMessage) -> None:
        """As AsyncMPClient._send: never blocked forever by a dead core."""
        data = self._codec.encode(message)
        while not self._proc.input_socket.poll(_DEATH_POLL_MS, zmq.POLLOUT):
            self._proc.check_alive()
        self._proc.input_socket.send(data)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(AddRequest(request))

    def abort_requests(self, req_ids: list[str]) -> None:
        if req_ids:
            self._send(AbortRequests(list(req_ids)))

    def _next_message(self) -> CoreMessage:
        while not self._proc.output_socket.poll(_POLL_MS):
            self._proc.check_alive()
        return self._codec.decode(self._proc.output_socket.recv())

    def get_output(self) -> EngineCoreOutputs:
        while True:
            message = self._next_message()
            if isinstance(message, Outputs):
                return message.outputs
            if isinstance(message, UtilityResult):
                self._utility_results[message.call_id] = message
            elif isinstance(message, EngineDead):
                raise EngineDeadError(message.message)

    def call_utility(self, method: str):
        """Call a core utility. Outputs that arrive meanwhile are lost: call it idle."""
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id, method))
        while call_id not in self._utility_results:
            message = self._next_message()
            if isinstance(message, UtilityResult):
                self._utility_results[message.call_id] = message
            elif isinstance(message, EngineDead):
                raise EngineDeadError(message.message)
        return _utility_value(self._utility_results.pop(call_id))

    def shutdown(self) -> None:
        self._finalizer()
