"""Servers on the same CPUs taking turns at their engine steps (`--cpu-turns NAME`).

A chat model and an embedding model served side by side on a small machine compete for
the same cores. Run at the same time, their steps slow each other by far more than their
share of the CPU (each streams its weights through the caches and the memory bus the other
uses: docs/embeddings.md measured +44% chat latency beside a busy loop that only ran when a
core was idle). Taking turns, their steps never overlap:

    foreground (chat):   step | step | step |          | step | step | ...
    background (embed):                     | one step |             (waits its budget)

Every server started with the same `--cpu-turns NAME` on a host holds one lock (`flock` on
a small file in /dev/shm) for the length of each step. A server that finds the lock taken
marks itself waiting and looks again every WAITING_POLL_S; the holder, after its step, lets
a waiting server take the lock before its own next step (so two busy servers alternate).
A background server (`--cpu-turns-share F`) steps freely while no foreground server has
work; while one has (it stepped in the last FOREGROUND_LEASE_S), after a step of d seconds
it waits d * (1 - F) / F before asking again, so its steps take at most F of the time. At
F = 0.2 a 10 ms chat step rises by 2.5 ms on average; a single background step is never
cut, so keep its steps short (`--max-num-batched-tokens`). The wait is capped at
BUDGET_WAIT_MAX_S: the busy loop answers no health check while it waits.

The lock dies with its holder (flock), and every wait on another server has a time limit:
a server that crashes mid-step never blocks the others.

The shared page holds three numbers, each written with one 8-byte store:
    float64 [0] busy_until   time.monotonic() until which a foreground server has work
    float64 [1] waiting_at   when a server last found the lock taken (0: it got it since)
    int64   [2] turns        turns taken by the group (written under the lock)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from engine.config import CPU_TURNS_NAME_RE, EngineConfig

logger = logging.getLogger(__name__)

# A foreground server counts as busy this long after its last step.
FOREGROUND_LEASE_S = 0.25
# A background server's longest wait for its budget (well under the health check's 60 s).
BUDGET_WAIT_MAX_S = 10.0
# A server waiting for the lock looks again this often...
WAITING_POLL_S = 0.0002
# ...and the holder counts it as waiting while it looked this recently.
WAITING_FRESH_S = 0.005
# How long the holder, done with its step, waits for a waiting server to take the lock.
HANDOFF_TIMEOUT_S = 0.005
HANDOFF_POLL_S = 0.00005

_BUSY_UNTIL, _WAITING_AT = 0, 1  # indices into _times: the page's float64 [0] and [1]
_TURNS = 0  # index into _turns: the page's int64 [2] (bytes 16..23)


def turns_path(name: str) -> Path:
    """The file a group's servers share: /dev/shm/pagedserve-cpu-turns-NAME."""
    if not CPU_TURNS_NAME_RE.match(name):
        raise ValueError(f"--cpu-turns {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return folder / f"pagedserve-cpu-turns-{name}"


class CpuTurns:
    """One server's seat in a group (module doc). `turn()` wraps each engine step; one
    thread (the busy loop's) uses it."""

    def __init__(self, name: str, background_share: float | None = None):
        if background_share is not None and not 0.0 < background_share < 1.0:
            raise ValueError(f"--cpu-turns-share must be in (0, 1), got {background_share}")
        self.name = name
        self.background_share = background_share
        self.path = turns_path(name)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        if os.fstat(self._fd).st_size < mmap.PAGESIZE:
            os.ftruncate(self._fd, mmap.PAGESIZE)  # zeros: nobody busy, nobody waiting
        self._page = mmap.mmap(self._fd, mmap.PAGESIZE)
        self._times = memoryview(self._page)[:16].cast("d")
        self._turns = memoryview(self._page)[16:24].cast("q")
        self._next_turn_at = 0.0  # background: when its budget allows the next step
        self._waited_s = 0.0  # since take_waited_s()
        self.turns = 0

    @property
    def is_background(self) -> bool:
        return self.background_share is not None

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the group's CPUs for one step."""
        waited_from = now = time.monotonic()
        if self.is_background and now < self._next_turn_at and now < self._times[_BUSY_UNTIL]:
            time.sleep(self._next_turn_at - now)  # the budget: see the module doc
        self._lock()
        self._turns[_TURNS] += 1  # under the lock: no other writer
        self.turns += 1
        started = time.monotonic()
        self._waited_s += started - waited_from
        try:
            yield
        finally:
            self._hand_over(started)

    def _lock(self) -> None:
        """Take the lock, showing the holder that this server waits (module doc)."""
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                self._times[_WAITING_AT] = time.monotonic()
                time.sleep(WAITING_POLL_S)
        self._times[_WAITING_AT] = 0.0  # a server still waiting marks itself again

    def _hand_over(self, started: float) -> None:
        """Release the lock after a step begun at `started`. If another server waits, let it
        take the lock before this one's next step can (flock is not first come, first
        served: the releasing server would most often take it straight back)."""
        ended = time.monotonic()
        if not self.is_background:
            self._times[_BUSY_UNTIL] = ended + FOREGROUND_LEASE_S
        someone_waits = ended - self._times[_WAITING_AT] < WAITING_FRESH_S
        taken = self._turns[_TURNS]
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        if someone_waits:
            deadline = ended + HANDOFF_TIMEOUT_S
            while self._turns[_TURNS] == taken and time.monotonic() < deadline:
                time.sleep(HANDOFF_POLL_S)
        if self.is_background:
            share = self.background_share
            foreground_busy = ended < self._times[_BUSY_UNTIL]
            wait_s = (ended - started) * (1.0 - share) / share if foreground_busy else 0.0
            self._next_turn_at = ended + min(wait_s, BUDGET_WAIT_MAX_S)

    def take_waited_s(self) -> float:
        """Seconds spent waiting for turns since the last call."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited

    def close(self) -> None:
        """Leave the group (the file stays for the others; it holds no lock after this)."""
        self._times.release()
        self._turns.release()
        self._page.close()
        os.close(self._fd)


def turn_of(turns: CpuTurns | None) -> contextlib.AbstractContextManager[None]:
    """`turns.turn()`, or nothing to wait for where the server is in no group: the context
    each engine step runs in (the core's busy loop, the offline LLM)."""
    return turns.turn() if turns is not None else contextlib.nullcontext()


def join_cpu_turns(config: EngineConfig) -> CpuTurns | None:
    """This server's seat in its --cpu-turns group, if it has one."""
    device = config.device_config
    if device.cpu_turns is None:
        return None
    turns = CpuTurns(device.cpu_turns, device.cpu_turns_share)
    # Servers share a group only where they see the same file (one host; containers that
    # share /dev/shm): the path is logged so that a missing partner can be found.
    logger.info("--cpu-turns %s: %s server of the group at %s%s", device.cpu_turns,
                "a background" if turns.is_background else "a foreground", turns.path,
                f" (share {device.cpu_turns_share})" if turns.is_background else "")
    return turns
