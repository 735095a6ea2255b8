"""Helpers for the reliability tests (tests/server/reliability/).

    start_server(tokenizer_dir, limits=..., executor_kwargs=...)   in-process server over
                                                                   the echo FakeExecutor
    FakeServerProcess(tokenizer_dir, ...)                          the same in a subprocess
                                                                   (main thread: real signals)
    metric(text, name)                                             a value from /metrics
    child_pids(pid), wait_gone(pids)                               a process's children
    sse_data(text)                                                 the data lines of a stream

Run as a script, this module is FakeServerProcess's server:
    python -m tests.support.reliability_fixtures TOKENIZER_DIR JSON_OPTIONS
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from server.common.lifecycle import ServerLimits
from tests.support.server_fixtures import (
    REPO,
    LoggedServerProcess,
    ServerThread,
    build_fake_server,
    start_fake_server,
)


def start_server(
    tokenizer_dir: Path,
    *,
    limits: ServerLimits | None = None,
    executor_kwargs: dict | None = None,
    max_model_len: int = 256,
    max_num_seqs: int = 64,
    shutdown_timeout_s: float = 5.0,
    async_scheduling: bool = False,
) -> ServerThread:
    """A real server (HTTP, AsyncEngine, core process) over the echo FakeExecutor."""
    return start_fake_server(tokenizer_dir, limits=limits, executor_kwargs=executor_kwargs,
                             max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             shutdown_timeout_s=shutdown_timeout_s,
                             async_scheduling=async_scheduling)


class FakeServerProcess(LoggedServerProcess):
    """The FakeExecutor server in its own process (so SIGTERM is a real signal)."""

    def __init__(self, tokenizer_dir: Path, *, limits: ServerLimits | None = None,
                 executor_kwargs: dict | None = None, max_model_len: int = 256,
                 max_num_seqs: int = 64, shutdown_timeout_s: float = 5.0):
        options = {
            "limits": asdict(limits or ServerLimits()), "executor_kwargs": executor_kwargs,
            "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "shutdown_timeout_s": shutdown_timeout_s,
        }
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")])}
        super().__init__([sys.executable, "-m", "tests.support.reliability_fixtures",
                          str(tokenizer_dir), json.dumps(options)], env)

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """Last resort (test clean-up): SIGKILL the server and its children."""
        for pid in child_pids(self.process.pid) + [self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(10)


def child_pids(pid: int) -> list[int]:
    """The live child processes of `pid` (from /proc; Linux)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces and parentheses.
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry.name))
    return children


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> dict[int, str]:
    """Wait until none of `pids` is alive; return the survivors' command lines.

    (multiprocessing's resource tracker leaves a moment after its parent: it exits when
    it reads the end of the pipe the parent held.) The deadline is generous: they are
    gone within milliseconds on an idle machine, later on a busy one; a process that
    really stays stays past any deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if pid_alive(pid)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    survivors = {}
    for pid in alive:
        try:
            survivors[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return survivors


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of metric `name` (written with '_' or ':' after 'pagedserve'), summed
    over the series whose labels include `labels`; None if there is no such series."""
    suffix = name.removeprefix("pagedserve_").removeprefix("pagedserve:")
    pattern = re.compile(r"^pagedserve[_:]" + re.escape(suffix) + r"(\{[^}]*\})? (\S+)$")
    total, found = 0.0, False
    for line in text.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        series_labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(series_labels.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
            found = True
    return total if found else None


def sse_data(text: str) -> list[str]:
    """The payloads of a `text/event-stream` body's `data:` lines."""
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def _serve_main(tokenizer_dir: str, options_json: str) -> int:
    import asyncio

    from server.http.cli import configure_logging

    options = json.loads(options_json)
    configure_logging("info")
    server = build_fake_server(
        Path(tokenizer_dir), limits=ServerLimits(**options["limits"]),
        executor_kwargs=options["executor_kwargs"], max_model_len=options["max_model_len"],
        max_num_seqs=options["max_num_seqs"], shutdown_timeout_s=options["shutdown_timeout_s"],
        log_level="info")
    asyncio.run(server.run())
    return 0


if __name__ == "__main__":
    sys.exit(_serve_main(sys.argv[1], sys.argv[2]))
