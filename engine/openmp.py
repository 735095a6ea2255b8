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
"""

from __future__ import annotations

import logging
import os
import sys

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
