"""--cpu-turns (engine/core/cpu_turns.py): servers of a group never step at the same time; a
background server keeps to its share while a foreground one has work, yet is never
starved; a holder that dies frees the CPUs; the flags are checked at start."""

from __future__ import annotations

import argparse
import fcntl
import multiprocessing
import os
import time
import uuid

import pytest

from engine.config import EngineConfig, cpu_turns_name, open_fraction
from engine.core.cpu_turns import CpuTurns, turns_path

STEP_S = 0.002


@pytest.fixture
def group():
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    turns_path(name).unlink(missing_ok=True)


def _steps(name: str, share: float | None, run_s: float, start_at: float, out) -> None:
    """A server's busy loop in miniature: steps of STEP_S (a sleep) for `run_s`, each in a
    turn; puts the (start, end) time of every step on `out`."""
    turns = CpuTurns(name, share)
    while time.monotonic() < start_at:
        time.sleep(0.001)
    intervals = []
    while time.monotonic() < start_at + run_s:
        with turns.turn():
            started = time.monotonic()
            time.sleep(STEP_S)
            intervals.append((started, time.monotonic()))
    turns.close()
    out.put(intervals)


def _run_group(name: str, shares: list[float | None], run_s: float = 1.0):
    """Each share's server stepping for `run_s` (None: a foreground one); their steps."""
    context = multiprocessing.get_context("spawn")
    queues = [context.Queue() for _ in shares]
    start_at = time.monotonic() + 3.0  # every child imported and waiting
    children = [context.Process(target=_steps, args=(name, share, run_s, start_at, out))
                for share, out in zip(shares, queues, strict=True)]
    for child in children:
        child.start()
    steps = [out.get(timeout=60) for out in queues]
    for child in children:
        child.join(timeout=10)
        assert child.exitcode == 0
    return steps


def assert_no_overlap(first, second) -> None:
    for a_start, a_end in first:
        for b_start, b_end in second:
            assert a_end <= b_start or b_end <= a_start, "two steps of a group overlapped"


def test_steps_never_overlap_and_the_background_keeps_its_share(group):
    share = 0.2
    foreground, background = _run_group(group, [None, share])
    assert len(foreground) > 50
    # Never starved: the background steps while the foreground steps back to back.
    inside = [b for b in background if foreground[0][0] < b[0] < foreground[-1][1]]
    assert len(inside) >= 3
    assert_no_overlap(foreground, background)
    # While the foreground is busy, after a step of d seconds the background waits at least
    # d * (1 - share) / share (its turn spans the recorded step, so the bound holds for it).
    for (start, end), (next_start, _) in zip(background, background[1:], strict=False):
        if foreground[0][0] < start and next_start < foreground[-1][1]:
            assert next_start - end >= (end - start) * (1 - share) / share - 1e-4


def test_two_busy_foreground_servers_alternate(group):
    first, second = _run_group(group, [None, None])
    assert_no_overlap(first, second)
    # Each hands the lock over after its step: neither takes it straight back for long.
    assert min(len(first), len(second)) > 0.3 * (len(first) + len(second))


def test_a_background_server_alone_steps_without_waiting(group):
    turns = CpuTurns(group, 0.2)
    for _ in range(3):
        with turns.turn():
            time.sleep(STEP_S)
        # No foreground server is busy: the next turn may start at once.
        assert turns._next_turn_at <= time.monotonic()
    assert turns.turns == 3
    turns.close()


def _die_holding_the_turn(name: str) -> None:
    turns = CpuTurns(name)
    with turns.turn():
        os._exit(0)


def test_a_server_dying_mid_step_frees_the_cpus(group):
    child = multiprocessing.get_context("spawn").Process(target=_die_holding_the_turn,
                                                         args=(group,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    fd = os.open(turns_path(group), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the lock outlived it
    finally:
        os.close(fd)


def test_the_flags_are_checked():
    with pytest.raises(argparse.ArgumentTypeError):
        cpu_turns_name("../etc")
    for bad in ("0", "1", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            open_fraction(bad)
    with pytest.raises(ValueError, match="needs --cpu-turns"):
        EngineConfig.from_options("m", cpu_turns_share=0.2)
    with pytest.raises(ValueError, match="async-scheduling"):
        EngineConfig.from_options("m", cpu_turns="chat", async_scheduling=True)
    with pytest.raises(ValueError, match="share"):
        CpuTurns("chat", 1.0)
