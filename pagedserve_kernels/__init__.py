"""pagedserve's device kernels: C++ for the CPU, Triton for CUDA.

* C++ (``pagedserve_kernels/cpu/``, most of the code: ~3.2k lines), one extension built on first use
  by ``pagedserve_kernels.cpu_kernels``: paged attention, the int4/int8 and GGUF linears, the small
  fused ops between the matmuls, and a dense decoder's whole layer stack.
* Triton (this package, ~0.6k lines), for CUDA: the attention backends and LoRA:
  ``reshape_and_cache`` scatters this step's new K/V into the paged cache (``triton`` and
  ``flash_attn``); ``paged_attention`` is causal attention of a mixed prefill/decode batch
  over it (``triton``); ``lora_sgmv.lora_add`` runs a linear's LoRA side path for every
  adapter of a step (shrink, then expand, grouped by adapter).

What each is tested against (its reference), and where:

* Triton ``reshape_and_cache``, ``paged_attention``: ``pagedserve_kernels.reference`` (torch);
  tests/kernels/test_attention_kernels.py (under the Triton interpreter without CUDA).
* Triton ``lora_sgmv``: a float64 shrink-then-expand per adapter group;
  tests/kernels/test_lora_sgmv.py (the interpreter without CUDA).
* C++ ``paged_attention.cpp``: ``pagedserve_kernels.reference.paged_attention_ref``; tests/kernels/test_attention_kernels.py,
  test_paged_attention_isa.py, test_sliding_window_kernels.py, test_softcap_kernels.py.
* C++ ``prefill_attention.cpp``: a float64 causal softmax and torch's bf16 SDPA beside it;
  tests/kernels/test_prefill_attention.py.
* C++ ``quant_linear.cpp``, ``quant_blocked.cpp``: ``pagedserve_kernels.reference.quant_linear_ref``;
  tests/kernels/test_quant.py, test_int4_blocked_isa.py.
* C++ ``gguf_linear.cpp``: gguf-py's ``dequantize`` and a float64 matmul; tests/kernels/test_gguf_kernels.py.
* C++ ``fused_ops.cpp``: the torch paths of the modules they replace (RMSNorm, rotary,
  SiluAndMul, the KV-cache write); tests/engine/test_fused_ops.py.
* C++ ``decoder_stack.cpp``: the Python decoder layers, bit for bit; tests/kernels/test_fused_decoder.py.
* C++ ``lora.cpp``: a float64 shrink-then-expand per adapter group; tests/kernels/test_lora_kernel.py.

Triton is imported lazily, on the first kernel launch, so ``import pagedserve_kernels``, the C++ kernels
and the torch references work on machines without triton.

Compiled or interpreted? With triton 3.9 the choice is made per process, when ``triton`` is
first imported: ``@triton.jit`` reads ``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``)
when it *decorates* a function, and triton.language's own helpers (``tl.zeros``, ``tl.max``,
``tl.sum``, ...) are decorated at ``import triton`` time. A kernel decorated in interpret mode
that calls helpers decorated in compiled mode fails ("Cannot call @triton.jit'd outside of the
scope of a kernel"); the launch itself never reads the variable. Hence:

* the kernel modules keep their kernels as plain functions; ``jit_kernel`` decorates them on
  first launch in the same mode triton.language was imported in;
* when this package is the first to import triton and CUDA is unavailable, it sets
  ``TRITON_INTERPRET=1`` (if unset) just before the import: without a GPU the interpreter is
  the only way Triton runs;
* to interpret on a CUDA machine, export ``TRITON_INTERPRET=1`` before anything imports triton.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

_jit_cache: dict[Callable[..., Any], Any] = {}


def triton_available() -> bool:
    """True if triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def import_triton() -> tuple[Any, Any]:
    """Import and return ``(triton, triton.language)``.

    If triton is not imported yet and CUDA is unavailable, ``TRITON_INTERPRET`` defaults to
    ``1`` first (see the module docstring).
    """
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the pagedserve Triton kernels need triton; pagedserve_kernels.reference has torch versions"
        ) from e
    return triton, tl


def triton_interpreted() -> bool:
    """True if triton in this process runs kernels under its interpreter (imports triton)."""
    _, tl = import_triton()
    return type(tl.zeros).__name__ == "InterpretedFunction"


def jit_kernel(fn: Callable[..., Any]) -> Any:
    """Return ``triton.jit(fn)`` in the process's triton mode (compiled or interpreted); cached.

    ``fn`` is a plain function whose module refers to ``tl`` as a global; that global is bound
    to ``triton.language`` here, so the kernel modules need not import triton at import time.
    Its ``tl.constexpr`` annotations must be strings (``from __future__ import annotations``).
    """
    if fn not in _jit_cache:
        triton, tl = import_triton()
        fn.__globals__["tl"] = tl
        interpret = triton_interpreted()
        knobs = getattr(triton, "knobs", None)
        if knobs is not None:  # triton >= 3.4: scope() restores the knobs and the env var.
            with knobs.runtime.scope():
                knobs.runtime.interpret = interpret
                _jit_cache[fn] = triton.jit(fn)
        else:  # older triton reads os.environ directly when decorating.
            saved = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
            try:
                _jit_cache[fn] = triton.jit(fn)
            finally:
                if saved is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = saved
    return _jit_cache[fn]


def check_device(tensor: torch.Tensor) -> None:
    """Raise a clear error if Triton cannot run a kernel on ``tensor``'s device."""
    if tensor.device.type != "cuda" and not triton_interpreted():
        raise RuntimeError(
            f"Triton kernels on {tensor.device.type} tensors need the Triton interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported in this process"
        )


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1): Triton tile sizes. Example: 80 -> 128."""
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: how many tiles of b cover a. Example: cdiv(20, 16) -> 2."""
    return -(-a // b)


# Imported last: the kernel modules use the helpers above.
from .paged_attention import paged_attention  # noqa: E402
from .reference import paged_attention_ref, reshape_and_cache_ref  # noqa: E402
from .reshape_and_cache import reshape_and_cache  # noqa: E402

__all__ = [
    "check_device",
    "import_triton",
    "jit_kernel",
    "paged_attention",
    "paged_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "triton_available",
    "triton_interpreted",
]
