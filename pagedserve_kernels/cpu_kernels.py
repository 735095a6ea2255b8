"""The C++ CPU kernels, one extension built on first use.

- `pagedserve_kernels/cpu/paged_attention.cpp`: attention of decode tokens and prompt-chunk
  tokens reading K and V straight from the head-major paged cache, where the
  pure-torch path must first gather each request's blocks into a dense copy: at
  batch 64 and ~500-token contexts that gather moves more bytes per step than the
  attention itself reads.
- `pagedserve_kernels/cpu/prefill_attention.cpp`: causal attention of long bfloat16 prompt
  chunks with AVX512-BF16 dot products (torch's CPU flash kernel computes them in float32).
- `pagedserve_kernels/cpu/quant_linear.cpp`: int4/int8 weight-only linears in groups of 32
  (`quant_blocked.cpp`: int4/int8 in blocks of 16 output rows, the layout for wide batches)
  with float16 scales (GGUF Q4_0/Q4_1/Q8_0 exactly), for small decode batches.
- `pagedserve_kernels/cpu/fused_ops.cpp`: the small ops between the matmuls (RMSNorm with the
  residual add, RoPE, SiLU x up, the KV-cache write), one call each.
- `pagedserve_kernels/cpu/lora.cpp`: the LoRA side path of a linear, every adapter of the
  step in one call (engine/lora/layers.py).
- `pagedserve_kernels/cpu/decoder_stack.cpp`: a dense decoder's layers in one call, the kernels
  above one after another (engine.models.fused_decoder). `pagedserve_kernels/cpu/ops.h` declares
  every entry point.

The extension is compiled with `torch.utils.cpp_extension.load` (a C++ compiler and ninja;
`-march=native`, so for this machine; ~1 min of compiler time, four files built in
parallel; `make venv` builds it, `python -m pagedserve_kernels.cpu_kernels` too) into
$TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) once, and loaded from
there afterwards. Where it cannot be built, `paged_attention_kernel()` returns None
and the backend keeps the torch path. `PAGEDSERVE_CPU_KERNELS=0` turns it off.
What each kernel is tested against: the table in `pagedserve_kernels/__init__.py`.

The few-row int4/int8/GGUF kernels round the activations per group to int16 or int8
(`PAGEDSERVE_ACTIVATION_PRECISION=int16|int8`, read when the module is loaded; unset:
`default_activation_precision()`); `set_activation_precision` changes it in-process
(benchmarks, tests). See `pagedserve_kernels/cpu/group32_activations.h`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("cpu") / name
           for name in ("paged_attention.cpp", "prefill_attention.cpp", "quant_linear.cpp", "quant_blocked.cpp", "gguf_linear.cpp",
                        "fused_ops.cpp", "decoder_stack.cpp", "lora.cpp", "bindings.cpp")]
HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)  # the sizes the C++ code is instantiated for
_UNSET = object()
_kernel: object = _UNSET
_fused_ops: object = _UNSET


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0"


def paged_attention_kernel() -> Callable[..., None] | None:
    """`fn(out, query, kv_cache, block_table, row_tables, seq_lens, scale)`, or None if
    unavailable.

    Query row b attends to the first seq_lens[b] positions of the sequence in
    block_table[row_tables[b]] (row_tables empty: table row b).
    out, query: [B, Hq, D] contiguous, of one dtype (float32, or bfloat16 / float16: computed
    in float32, rounded once), D in HEAD_SIZES; kv_cache: float32,
    bfloat16 or float16 [2, Hkv, num_blocks, block_size, D]; block_table: int32
    [R, max_blocks]; row_tables, seq_lens: int32 [B]. Bad shapes or indices raise
    RuntimeError before any work. Built (or loaded) once per process.
    """
    module = cpu_kernels()
    return None if module is None else module.paged_attention


PREFILL_HEAD_SIZES = (64, 128, 256)  # prefill_attention.cpp's instantiations
_prefill: object = _UNSET


def prefill_attention_kernel() -> Callable[..., None] | None:
    """`fn(out, query, key, value, scale)`: causal bfloat16 attention of the last L of S
    positions (out/query [L, Hq, D], key/value [Hkv, S, D], last dims contiguous, D in
    PREFILL_HEAD_SIZES), or None where the build has no AVX512-BF16 code (or no build).
    Decided once per process."""
    global _prefill
    if _prefill is _UNSET:
        module = cpu_kernels()
        _prefill = (module.prefill_attention
                    if module is not None and module.prefill_attention_available() else None)
    return _prefill


def fused_ops_for(tensor) -> object | None:
    """The kernel module when `tensor` lives on the CPU and the kernels are built, else
    None (the caller then takes its torch path). Decided once per process: this runs
    several times per layer and step, so it reads no environment variable."""
    global _fused_ops
    if tensor.device.type != "cpu":
        return None
    if _fused_ops is _UNSET:
        _fused_ops = cpu_kernels()
    return _fused_ops


def cpu_kernels():
    """The built extension module (`paged_attention`, `int4_linear`,
    `int8_linear`), or None where it cannot be built or PAGEDSERVE_CPU_KERNELS=0.
    A bad PAGEDSERVE_ACTIVATION_PRECISION raises ValueError here, at start-up."""
    global _kernel
    if not enabled():
        return None
    if _kernel is _UNSET:
        bits = ACTIVATION_PRECISIONS[activation_precision_from_env()]
        _kernel = _build()
        if _kernel is not None:
            _kernel.set_activation_precision(bits)
    return _kernel


ACTIVATION_PRECISION_ENV = "PAGEDSERVE_ACTIVATION_PRECISION"
ACTIVATION_PRECISIONS = {"int16": 16, "int8": 8}  # name -> bits of xq


def default_activation_precision() -> str:
    """The activation precision used where PAGEDSERVE_ACTIVATION_PRECISION (and the engine's
    --activation-precision) is unset: int8 on a CPU with AVX-512 VNNI, whose vpdpbusd takes
    four u8 x s8 products per 32-bit lane, twice int16's vpdpwssd; int16 elsewhere (measured
    there: int8 gains less without VNNI). On a Zen 5 with VNNI int8 cost +0.39% perplexity on
    the default model in bfloat16 and prefilled 1.4x faster (docs/cpu-kernels.md, "The
    activation default")."""
    return "int8" if avx512_vnni() else "int16"


def avx512_vnni(flags: Collection[str] | None = None) -> bool:
    """Whether a CPU with these feature flags (None: this one's) has AVX-512 VNNI, so that
    the u8 x s8 kernels take vpdpbusd."""
    flags = set(_cpu_flags_line().split()) if flags is None else flags
    return {"avx512f", "avx512bw", "avx512_vnni"} <= set(flags)


def activation_precision_from_env() -> str:
    """PAGEDSERVE_ACTIVATION_PRECISION ("int16" or "int8"), else this CPU's default."""
    value = os.environ.get(ACTIVATION_PRECISION_ENV, "").strip().lower()
    if not value:
        return default_activation_precision()
    if value not in ACTIVATION_PRECISIONS:
        raise ValueError(f"{ACTIVATION_PRECISION_ENV}={value!r}: expected one of "
                         f"{', '.join(ACTIVATION_PRECISIONS)}")
    return value


def set_activation_precision(name: str) -> None:
    """Round the few-row kernels' activations to `name` ("int16" / "int8") from the next
    call on (every thread; a call in flight keeps the precision it started with)."""
    if name not in ACTIVATION_PRECISIONS:
        raise ValueError(f"activation precision {name!r}: expected one of {', '.join(ACTIVATION_PRECISIONS)}")
    module = cpu_kernels()
    if module is not None:
        module.set_activation_precision(ACTIVATION_PRECISIONS[name])


def activation_precision() -> str | None:
    """The precision the kernels use now, or None without kernels."""
    module = cpu_kernels()
    if module is None:
        return None
    bits = module.activation_precision()
    return next(name for name, b in ACTIVATION_PRECISIONS.items() if b == bits)


NAME = "pagedserve_cpu_kernels"
# torch waits forever on the lock file of a build that was killed midway; one this
# old is from such a build (a real one takes about a minute).
STALE_LOCK_S = 600


def build_directory() -> Path:
    """One build per torch version, CPU feature set (`-march=native` code must not
    run on a CPU without those features, e.g. from a home directory shared over NFS)
    and source text (two checkouts of different versions never rebuild each other's)."""
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    version = torch.__version__.replace("+", "_").replace(".", "_")
    return Path(root) / f"{NAME}_torch{version}_isa{_cpu_features_tag()}_src{_sources_tag()}"


def _sources_tag() -> str:
    """A digest of every C++ source and header of pagedserve_kernels/cpu."""
    digest = hashlib.sha256()
    for path in sorted(SOURCES[0].parent.glob("*.[ch]*")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:8]


def _cpu_flags_line() -> str:
    """The "flags" line of /proc/cpuinfo ("" where there is none)."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")), "")
    except OSError:
        return ""


def _cpu_features_tag() -> str:
    flags = _cpu_flags_line()
    return hashlib.sha256((flags or platform.processor()).encode()).hexdigest()[:8]


def toolchain_available() -> bool:
    """A C++ compiler and ninja (the one pip installs beside this Python counts)."""
    return shutil.which("c++") is not None and _ninja_dir() is not None


def _ninja_dir() -> str | None:
    """Where `ninja` is: on PATH, or in this Python's bin/ (a virtualenv not activated)."""
    found = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    return None if found is None else str(Path(found).parent)


def _put_ninja_on_path() -> None:
    # torch runs `ninja` from PATH.
    ninja_dir = _ninja_dir()
    if ninja_dir is not None and shutil.which("ninja") is None:
        os.environ["PATH"] = f"{ninja_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def _build():
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        lock = directory / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing a stale build lock left by a killed build: %s", lock)
            lock.unlink(missing_ok=True)
        if not (directory / f"{NAME}.so").exists():
            logger.info("building the C++ CPU kernels (attention, quantized linears) for this "
                        "CPU with the system compiler, once (~1 min of compiler time) into %s", directory)
        module = load(
            name=NAME,
            sources=[str(source) for source in SOURCES],
            build_directory=str(directory),
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, ...: keep the torch path
        logger.warning("C++ CPU kernels unavailable (attention takes the torch path, "
                       "quantized linears their dense weights): %s",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    logger.info("C++ CPU kernels ready (%.1f s)", time.perf_counter() - start)
    return module


if __name__ == "__main__":  # `python -m pagedserve_kernels.cpu_kernels`: build now (make venv does)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = cpu_kernels()
    print(f"C++ CPU kernels: {built.__file__ if built is not None else 'unavailable'}")
