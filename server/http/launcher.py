"""`pagedserve serve --api-server-count N`: N API server processes share one engine core.

    launcher (the `serve` process; this module)
      ├─ binds the listening socket once (a taken port fails here, before anything starts)
      ├─ creates PROMETHEUS_MULTIPROC_DIR (a temporary directory, removed at exit)
      ├─ engine core   (SharedCoreProcess: one process; its input is a ROUTER that every
      │                 frontend shares, its outputs one PUSH per frontend; see
      │                 engine/core/core_proc.py and engine/ipc.py)
      └─ API server k, k = 0..N-1 (spawned): uvicorn on the inherited listening socket,
                        its own tokenizer, AsyncEngine (detokenization, SSE),
                        AsyncSharedCoreClient and multiprocess metrics

      client ─TCP─▶ listening socket ─accept (whichever API server the kernel wakes)─▶
                    API server k ─AddRequest─▶ core ─only k's outputs─▶ API server k

Why one inherited socket rather than SO_REUSEPORT: the launcher binds it once, so a
taken port fails at once and `--port 0` (any free port) gives every API server the
same port; one accept queue means a connection waits for whichever process is free,
where SO_REUSEPORT would hash it onto one socket whatever that process is doing (and
keep hashing onto the socket of a process that died). multiprocessing's spawn passes
the socket to each child (a duplicated file descriptor).

Each API server is a whole frontend (server/api_server.APIServer over the shared core).
Request ids are uuid4s, and the core refuses an id already in use by any frontend; an
abort from API server k touches only k's requests. What is per API server, not per
server: admission control (`--max-queued-requests` caps each one's queue), the
x-ray's prompt and output text (an API server knows the text of its own requests only;
the x-ray's counts, blocks and queues are the core's, whole). Every response carries
`x-pagedserve-api-server: k`. /metrics from any API server renders the whole server
(server/common/metrics.py: prometheus-client's multiprocess mode).

Stopping. SIGTERM and SIGINT are the launcher's alone: the API servers and the core
ignore both, so a Ctrl-C delivered to the whole process group is one stop, not N+2.
  * The first signal asks every API server to drain (503 for new requests; the ones in
    flight get --shutdown-timeout), a second one to abort what is left at once. Once all
    have exited the launcher sends the core Shutdown and waits for it (then terminate,
    kill), closes the socket and removes its temporary directories: no process is left.
  * An API server that exits on its own stops the whole server the same way (exit 1).
  * An engine core that dies: every API server notices (EngineDead, or its pid gone) and
    answers as a single server does (503 on /health and on requests); they keep doing so
    until the launcher is stopped.
  * A launcher that dies without stopping them: the core and the API servers see their
    parent gone and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.executor.abstract import ExecutorSpec
from engine.frontend.core_client import EngineStartupError
from engine.frontend.shared_core_client import SharedCoreProcess
from engine.ipc import SharedCoreLink
from server.http.api_server import APIServer, ServeOptions, bind_socket
from server.http.torch_free import keep_torch_out

logger = logging.getLogger("pagedserve")

_POLL_S = 0.1
# After --shutdown-timeout, how long the API servers get to finish their drain and exit
# before they are told to abort, then terminated.
_EXIT_GRACE_S = 10.0


@dataclass
class ApiServerArgs:
    """What API server `index` is started with (pickled by multiprocessing's spawn;
    the socket travels as a duplicated file descriptor)."""

    index: int
    sock: socket.socket
    options: ServeOptions
    engine_config: EngineConfig
    model_dir: str
    served_model_names: list[str]
    link: SharedCoreLink
    launcher_pid: int


# ---------------------------------------------------------------- API server process
def run_api_server(args: ApiServerArgs, stop, force, ready) -> None:
    """Entry point of API server process `args.index` (start method: spawn).

    `stop` / `force` / `ready`: multiprocessing Events. The launcher sets `stop` to
    drain, then `force` to abort what is left; this process sets `ready` once uvicorn
    listens. Exits 0 after a clean stop, 1 if it could not start.
    """
    keep_torch_out()  # the engine core runs in its own process
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's (see the module doc)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=args.options.log_level.upper(),
        format=(f"%(asctime)s %(levelname)s [api-server {args.index} pid={os.getpid()}] "
                "%(name)s: %(message)s"))
    logging.getLogger("pagedserve.access").setLevel(logging.INFO)
    server = APIServer(args.options, args.engine_config, args.model_dir,
                       args.served_model_names, shared_core=args.link, sock=args.sock)
    threading.Thread(target=_follow_launcher, args=(server, args.launcher_pid, stop, force),
                     daemon=True, name="launcher-watch").start()

    async def serve() -> None:
        await server.start()
        serving = asyncio.ensure_future(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        ready.set()
        await serving

    try:
        asyncio.run(serve())
    except EngineStartupError as exc:
        print(f"error: the engine failed to start: {exc}", file=sys.stderr)
        sys.exit(1)
    # Stopped cleanly: sockets, the core link and uvicorn are closed, the metrics are in
    # their files. Skip the interpreter's teardown of the start-up heap (1.5-3 s on a
    # busy machine, which the launcher's stop would wait for).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _follow_launcher(server: APIServer, launcher_pid: int, stop, force) -> None:
    """Turn the launcher's Events (or its death) into `server.request_stop` calls:
    the first drains, the second aborts what is left."""
    asked = 0
    while True:
        launcher_gone = os.getppid() != launcher_pid
        wanted = 2 if force.is_set() or launcher_gone else 1 if stop.is_set() else 0
        while asked < wanted:
            asked += 1
            server.request_stop("the launcher is gone" if launcher_gone
                                else "the launcher asked to stop")
        time.sleep(_POLL_S)


# ---------------------------------------------------------------- launcher
class _Signals:
    """Counts SIGTERM/SIGINT; the handler only counts (it may run while the main thread
    holds an Event's lock), `sync()` passes the count on to the Events."""

    def __init__(self, stop, force):
        self.stop, self.force = stop, force
        self.count = 0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame) -> None:
        self.count += 1

    def sync(self) -> None:
        if self.count >= 1 and not self.stop.is_set():
            logger.info("stopping: the API servers drain (up to their --shutdown-timeout)")
            self.stop.set()
        if self.count >= 2 and not self.force.is_set():
            logger.warning("stopping again: the API servers abort their remaining requests")
            self.force.set()


def run_launcher(
    options: ServeOptions,
    engine_config: EngineConfig,
    model_dir: str | Path,
    served_model_names: list[str],
    api_server_count: int,
    executor_spec: ExecutorSpec | None = None,
) -> int:
    """Serve with `api_server_count` (>= 2) API server processes over one engine core
    until SIGTERM/SIGINT (see the module doc). Returns the exit status: 0 after a
    requested stop, 1 when an API server exited on its own (e.g. the engine could not
    start: it printed why). Raises ValueError for an invalid set-up, OSError when the
    address cannot be bound."""
    if api_server_count < 2:
        raise ValueError(f"the launcher runs 2 or more API servers, not {api_server_count}")
    if options.engine_mode != "process":
        raise ValueError("--api-server-count > 1 needs the engine core in its own process "
                         f"(engine mode {options.engine_mode!r} runs it inside the frontend)")
    sock = bind_socket(options.host, options.port)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    metrics_dir = tempfile.mkdtemp(prefix="pagedserve-metrics-")
    previous_metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by every child
    spawn = multiprocessing.get_context("spawn")
    stop, force = spawn.Event(), spawn.Event()
    signals = _Signals(stop, force)
    signals.install()
    core: SharedCoreProcess | None = None
    servers: list[multiprocessing.process.BaseProcess] = []
    try:
        core = SharedCoreProcess(engine_config, executor_spec, api_server_count,
                                 options.log_level)
        ready_events = []
        for index in range(api_server_count):
            ready = spawn.Event()
            args = ApiServerArgs(index, sock, options, engine_config, str(model_dir),
                                 list(served_model_names), core.link(index), os.getpid())
            process = spawn.Process(target=run_api_server, args=(args, stop, force, ready),
                                    name=f"APIServer-{index}")
            process.start()
            servers.append(process)
            ready_events.append(ready)
        return _supervise(servers, ready_events, core, signals, url, model_dir,
                          served_model_names)
    finally:
        stop.set()
        _stop_api_servers(servers, signals, options.shutdown_timeout_s)
        if core is not None:
            logger.info("API servers stopped; stopping the engine core")
            core.close()
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if previous_metrics_dir is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous_metrics_dir
        signals.restore()
        logger.info("server stopped")


def _supervise(servers, ready_events, core: SharedCoreProcess, signals: _Signals, url: str,
               model_dir, served_model_names: list[str]) -> int:
    """Watch the children until a stop is asked for (0) or an API server exits (1)."""
    announced = core_death_logged = False
    while True:
        signals.sync()
        if signals.stop.is_set():
            return 0
        for index, process in enumerate(servers):
            if not process.is_alive():
                logger.error("API server %d (pid %s) exited (exit code %s): stopping the "
                             "server", index, process.pid, process.exitcode)
                return 1
        if not announced and all(ready.is_set() for ready in ready_events):
            announced = True
            logger.info("serving %s (%s) at %s; %d API servers (pids %s), engine core pid %d",
                        ", ".join(served_model_names), model_dir, url, len(servers),
                        ", ".join(str(p.pid) for p in servers), core.pid)
        if not core_death_logged and not core.process.is_alive():
            core_death_logged = True
            logger.error("the engine core process exited (exit code %s); the API servers "
                         "answer 503 until the server is stopped", core.process.exitcode)
        sentinels = [p.sentinel for p in servers]
        if not core_death_logged:
            sentinels.append(core.process.sentinel)
        multiprocessing.connection.wait(sentinels, timeout=_POLL_S)


def _stop_api_servers(servers, signals: _Signals, shutdown_timeout_s: float) -> None:
    """Wait for the API servers to drain and exit (`stop` is set); past the drain and a
    grace period tell them to abort, then terminate and kill what is left."""
    deadline = time.monotonic() + shutdown_timeout_s + _EXIT_GRACE_S
    while any(p.is_alive() for p in servers) and time.monotonic() < deadline:
        signals.sync()
        multiprocessing.connection.wait([p.sentinel for p in servers if p.is_alive()],
                                        timeout=_POLL_S)
    if any(p.is_alive() for p in servers):
        signals.force.set()
        for process in servers:
            process.join(timeout=5)
    for process in servers:
        if process.is_alive():
            logger.warning("API server %s did not stop; terminating it", process.pid)
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            with contextlib.suppress(OSError):
                process.kill()
            process.join(timeout=5)
