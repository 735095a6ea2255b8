"""Triton kernels for pagedserve's paged KV cache, each with a pure-torch reference.

* ``reshape_and_cache``: scatter this step's new K/V into the paged cache.
* ``paged_attention``: causal attention of a mixed prefill/decode batch over the paged cache.
* ``kernels.reference``: readable torch versions of both (the ground truth for tests).

Triton is imported lazily, on the first kernel launch, so ``import kernels`` and the torch
references work on machines without triton.

Compiled or interpreted? With triton 3.x, ``@triton.jit`` reads ``TRITON_INTERPRET`` (through
``triton.knobs.runtime.interpret``, which re-reads the environment on each access) at
*decoration* time: it returns an ``InterpretedFunction`` or a ``JITFunction``, and the launch
itself never looks at the variable again. Module-level ``@triton.jit`` would therefore freeze the
mode at whatever the environment held when the module was first imported. To avoid that
import-order trap, the kernel modules keep their kernels as plain functions and ``jit_kernel``
decorates them on demand, once per mode: tensors not on CUDA always run under the interpreter
(the only way Triton runs on CPU), CUDA tensors run compiled unless ``TRITON_INTERPRET`` is set.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

_TRUE = ("1", "true", "on", "yes")
_jit_cache: dict[tuple[Callable[..., Any], bool], Any] = {}


def triton_available() -> bool:
    """True if triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def use_interpreter(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` run under the Triton interpreter."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE


def jit_kernel(fn: Callable[..., Any], interpret: bool) -> Any:
    """Return ``triton.jit(fn)``, compiled (``interpret=False``) or interpreted; cached.

    ``fn`` is a plain function whose module refers to ``tl`` as a global; that global is bound
    to ``triton.language`` here, so modules need not import triton at import time. Its
    ``tl.constexpr`` annotations must be strings (``from __future__ import annotations``).
    """
    key = (fn, interpret)
    if key not in _jit_cache:
        try:
            import triton
            import triton.language as tl
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the pagedserve Triton kernels need triton; use kernels.reference instead"
            ) from e
        fn.__globals__["tl"] = tl
        fn.__globals__["triton"] = triton
        knobs = getattr(triton, "knobs", None)
        if knobs is not None:  # triton >= 3.4: scope() restores the knobs and the env var.
            with knobs.runtime.scope():
                knobs.runtime.interpret = interpret
                _jit_cache[key] = triton.jit(fn)
        else:  # older triton reads os.environ directly when decorating.
            saved = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
            try:
                _jit_cache[key] = triton.jit(fn)
            finally:
                if saved is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = saved
    return _jit_cache[key]


# Imported last: the kernel modules use the helpers above.
from .paged_attention import paged_attention  # noqa: E402
from .reference import paged_attention_ref, reshape_and_cache_ref  # noqa: E402
from .reshape_and_cache import reshape_and_cache  # noqa: E402

__all__ = [
    "jit_kernel",
    "paged_attention",
    "paged_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "triton_available",
    "use_interpreter",
]
