"""What this CPU can do and how much of it we may use, read at run time.

Defaults that depend on the hardware (the compute dtype, when the int4 kernel
beats a dense matmul, how many threads to run) are decided here from the CPU's
feature flags and the cores this process is allowed, never tuned to one machine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else a conservative 4 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, for the memory calls Python does not wrap (glibc's malloc_trim,
    madvise); None where it cannot be loaded. A call a libc lacks raises AttributeError."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of /proc/cpuinfo (empty where there is no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16_reason(flags: frozenset[str] | None = None) -> str | None:
    """Why bfloat16 matmuls are fast here ("avx512_bf16", "amx_bf16"), or None if they are not."""
    flags = cpu_flags() if flags is None else flags
    for flag in ("amx_bf16", "avx512_bf16"):
        if flag in flags:
            return flag
    return None


def vector_isa(flags: frozenset[str] | None = None) -> str:
    """The widest vector ISA: 'avx512', 'avx2', or 'baseline'."""
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "baseline"


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may run on: its affinity set, capped by a cgroup CPU quota."""

    affinity: tuple[int, ...]  # os.sched_getaffinity(0)
    quota_cpus: float | None  # cgroup cpu.max quota / period, None when unlimited

    @property
    def num_threads(self) -> int:
        """Compute threads to run: one per usable core, never more than the quota allows."""
        cores = len(self.affinity)
        if self.quota_cpus is not None:
            cores = min(cores, max(1, math.floor(self.quota_cpus)))
        return max(1, cores)


def split_cpus(allowed: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(frontend CPUs, engine-core CPUs) for `--cpu-layout split`: the first allowed CPU
    for the frontend, the others for the core; with one CPU both share it.

    Example: allowed (0, 1, 2, 3) -> frontend (0,), engine core (1, 2, 3).
    """
    return (allowed, allowed) if len(allowed) < 2 else (allowed[:1], allowed[1:])


def pin_this_process(cpus: tuple[int, ...]) -> None:
    """Restrict every thread of this process (and the threads it starts later) to `cpus`."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs granted by the cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cpu_budget() -> CpuBudget:
    affinity = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") \
        else tuple(range(os.cpu_count() or 1))
    return CpuBudget(affinity=affinity, quota_cpus=cgroup_cpu_quota())


def describe() -> str:
    """One line for the start-up log: ISA, bf16 support, usable cores."""
    budget = cpu_budget()
    quota = f", cgroup quota {budget.quota_cpus:g} CPUs" if budget.quota_cpus else ""
    return (f"{vector_isa()}, native bf16: {native_bf16_reason() or 'no'}, "
            f"cores allowed {list(budget.affinity)}{quota}")
