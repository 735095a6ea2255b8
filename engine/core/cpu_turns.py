"""Servers on the same CPUs taking turns at their engine steps (`--cpu-turns NAME`).

A chat model and an embedding model served side by side on a small machine compete for
the same cores. Run at the same time, their steps slow each other by far more than their
share of the CPU (each streams its weights through the caches and the memory bus the other
uses: docs/embeddings.md measured +44% chat latency beside a busy loop that only ran when a
core was idle). Taking turns, their steps never overlap:

    foreground (chat):   step | step | step |          | step | step | ...
    background (embed):                     | one step |             (waits its budget)

Every server started with the same `--cpu-turns NAME` on a host holds one lock (`flock` on
a small file in /dev/shm) for the length of each step. A foreground server (the default)
takes the lock for each step, and after a step hands it over if a background server waits.
A background server (`--cpu-turns-share F`) runs its steps freely while no foreground server
has work; while one has (it stepped in the last FOREGROUND_LEASE_S), after a step of d
seconds it waits d * (1 - F) / F before asking again, so its steps take at most F of the
time. So at F = 0.2 a 10 ms chat step rises by 2.5 ms on average; a single background step
is never cut, so keep its steps short (`--max-num-batched-tokens`).

The lock dies with its holder (flock), and every wait on the other side has a time limit:
a server that crashes mid-step never blocks the others.

The shared page holds three numbers, written with single 8-byte stores:
    [0] foreground_busy_until  time.monotonic() until which a foreground server has work
    [1] background_waiting_at  when a background server last looked for its turn (0: none)
    [2] background_turns       turns taken by background servers (written under the lock)
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from engine.config import CPU_TURNS_NAME_RE

# A foreground server counts as busy this long after its last step.
FOREGROUND_LEASE_S = 0.25
# A background server looks for its turn this often while a foreground step runs...
BACKGROUND_POLL_S = 0.0002
# ...and the foreground server counts it as waiting while it looked this recently.
WAITING_FRESH_S = 0.005
# How long a foreground server waits for a waiting background server to take the lock.
HANDOFF_TIMEOUT_S = 0.005
HANDOFF_POLL_S = 0.00005

_BUSY_UNTIL, _WAITING_AT = 0, 1  # float64 slots
_TURNS = 2  # int64 slot


def turns_path(name: str) -> Path:
    """The file a group's servers share: /dev/shm/pagedserve-cpu-turns-NAME."""
    if not CPU_TURNS_NAME_RE.match(name):
        raise ValueError(f"--cpu-turns {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return folder / f"pagedserve-cpu-turns-{name}"


class CpuTurns:
    """One server's seat in a group (module doc). `turn()` wraps each engine step; one
    thread (the busy loop's) uses it. `waited_s` sums the time this server waited."""

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
        self.waited_s = 0.0
        self.turns = 0

    @property
    def is_background(self) -> bool:
        return self.background_share is not None

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the group's CPUs for one step."""
        turn = self._background_turn() if self.is_background else self._foreground_turn()
        with turn:
            self.turns += 1
            yield

    @contextlib.contextmanager
    def _foreground_turn(self) -> Iterator[None]:
        waited_from = time.monotonic()
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # a background step in progress ends first
        self.waited_s += time.monotonic() - waited_from
        try:
            yield
        finally:
            now = time.monotonic()
            self._times[_BUSY_UNTIL] = now + FOREGROUND_LEASE_S
            background_waits = now - self._times[_WAITING_AT] < WAITING_FRESH_S
            taken = self._turns[0]
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            if background_waits:
                # Without this wait the next step would take the lock again before the
                # waiting server's next look; it then waits out that server's step.
                deadline = now + HANDOFF_TIMEOUT_S
                while self._turns[0] == taken and time.monotonic() < deadline:
                    time.sleep(HANDOFF_POLL_S)

    @contextlib.contextmanager
    def _background_turn(self) -> Iterator[None]:
        waited_from = now = time.monotonic()
        if now < self._next_turn_at and now < self._times[_BUSY_UNTIL]:
            time.sleep(self._next_turn_at - now)  # the budget: see the module doc
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                self._times[_WAITING_AT] = time.monotonic()
                time.sleep(BACKGROUND_POLL_S)
        self._times[_WAITING_AT] = 0.0
        self._turns[0] += 1
        started = time.monotonic()
        self.waited_s += started - waited_from
        try:
            yield
        finally:
            ended = time.monotonic()
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            share = self.background_share
            foreground_busy = ended < self._times[_BUSY_UNTIL]
            self._next_turn_at = (ended + (ended - started) * (1.0 - share) / share
                                  if foreground_busy else ended)

    def close(self) -> None:
        """Leave the group (the file stays for the others; it holds no lock after this)."""
        self._times.release()
        self._turns.release()
        self._page.close()
        os.close(self._fd)
