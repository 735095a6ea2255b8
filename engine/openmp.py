"""How OpenMP's threads wait, chosen before torch loads (libgomp reads it once, then never).

torch's own parallel ops run on OpenMP threads; the CPU kernels run on their own spinning
pool (pagedserve_kernels/cpu/spin_pool.h). An OpenMP thread that keeps spinning after its
op (libgomp's default: ~3 ms) takes the core the kernels' pool needs next; one that sleeps
at once (PASSIVE) pays a futex wake-up at every op. So, unless the user chose (a set
OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins):

    this process (LLM offline)   GOMP_SPINCOUNT=10000: a short spin (~0.1 ms)
    an engine-core child         decoders PASSIVE (docs/performance.md: beside a busy
                                 process a spinning waiter starved its partner), encoders
                                 the short spin (BERT is ~60 small torch ops a forward)

Zen 5 pair, 1B Q4_0, 8 requests decoding offline: 90.1 ms a step with libgomp's default,
59.2 PASSIVE, 61.0 with the short spin; a 73-token BERT embedding over HTTP 11.7 ms
PASSIVE, ~7 with the short spin.

`small_ops_on_this_thread` keeps torch's small ops of a step (a few rows of logits: to
float32, softmax, random draws) off those threads altogether: see its comment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads after the OpenMP settings above are made
    import torch

SHORT_SPIN_COUNT = "10000"
_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_ours: dict[str, str] = {}  # what set_process_default put in os.environ
_warned = False
logger = logging.getLogger(__name__)


def set_process_default() -> None:
    """The short spin for this process, if torch has not loaded yet and the user chose
    nothing (called when `engine` is imported)."""
    if "torch" in sys.modules or users_choice():
        return
    os.environ["GOMP_SPINCOUNT"] = _ours["GOMP_SPINCOUNT"] = SHORT_SPIN_COUNT


def users_choice() -> bool:
    """Whether the environment holds an OpenMP wait setting we did not put there."""
    return any(name in os.environ and os.environ[name] != _ours.get(name)
               for name in _SETTINGS)


def child_env(encoder: bool) -> dict[str, str | None]:
    """Changes to the environment an engine-core child starts with (None: unset there);
    {} where the user chose."""
    if users_choice():
        return {}
    if encoder:
        return {"GOMP_SPINCOUNT": SHORT_SPIN_COUNT, "OMP_WAIT_POLICY": None}
    # GOMP_SPINCOUNT would override PASSIVE's zero spin.
    return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}


def warn_if_too_late() -> None:
    """A hint, once, for an offline engine whose torch loaded before `engine` with
    libgomp's own default (its ~3 ms spin slowed an 8-request decode step 1.5x)."""
    global _warned
    if not _warned and "GOMP_SPINCOUNT" not in _ours and not users_choice():
        _warned = True
        logger.warning("torch was imported before engine, so OpenMP keeps its default "
                       "~3 ms spin, which slows the CPU kernels; set GOMP_SPINCOUNT=%s (or "
                       "OMP_WAIT_POLICY=PASSIVE) in the environment, or import engine "
                       "first", SHORT_SPIN_COUNT)


# A few rows of logits are ~50K values a row; torch splits an op that size over its
# OpenMP threads, and each op first wakes a sleeping thread, which can cost more than the
# op on one thread. Zen 5 pair, the default model (49,152-token vocabulary), temperature
# 0.8, paired A/Bs (10 pairs each): one request served 0.950-0.964x the ITL in three runs,
# two offline 0.968x the time a step, four offline 1.031x (two threads win again);
# greedy unchanged (its one op, logits to float32, is cheaper).
SMALL_OP_VALUES = 1 << 17


@contextlib.contextmanager
def small_ops_on_this_thread(tensor: torch.Tensor) -> Iterator[None]:
    """torch's ops inside, on the calling thread, run on it alone if `tensor`, what they
    work on, is a CPU tensor of at most SMALL_OP_VALUES values (our C++ kernels follow
    torch's thread count too: call them outside); the count comes back on exit.

    torch.set_num_threads sets the calling thread's OpenMP and MKL counts (MKL's vector
    math, e.g. log, has threads of its own: setting OpenMP's count alone gained half as
    much) and the count a thread takes the first time it asks for one (an op that may
    go parallel, a kernel): a thread that has asked keeps its own meanwhile, one that
    first asks inside keeps 1."""
    import torch

    threads = torch.get_num_threads()
    if threads == 1 or not tensor.is_cpu or tensor.numel() > SMALL_OP_VALUES:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
