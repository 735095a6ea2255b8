"""One kernel source built for an instruction set other than this machine's -march=native
(the extended ISA tests: tests/kernels/test_int4_blocked_isa.py, tests/kernels/test_paged_attention_isa.py)."""
from __future__ import annotations

from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "pagedserve_kernels" / "cpu"


def build_for_isa(name: str, source: str, binding: str, cflags: list[str], tmp_path: Path):
    """The extension of pagedserve_kernels/cpu/`source` plus the pybind11 `binding` text, compiled
    with `cflags` (e.g. ["-O2", "-mavx2", "-mfma", "-mf16c"]) into `tmp_path`."""
    from torch.utils.cpp_extension import load

    binding_file = tmp_path / "binding.cpp"
    binding_file.write_text(binding)
    return load(name=name, sources=[str(binding_file), str(KERNELS / source)],
                extra_cflags=cflags + ["-fopenmp"], extra_include_paths=[str(KERNELS)],
                build_directory=str(tmp_path))
