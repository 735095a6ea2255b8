"""llama.cpp's `convert_hf_to_gguf.py`, run from its source tree, for the scripts that make
GGUF files (benchmarks/peers/make_bench_gguf.py, tests/data/gguf/make_fixtures.py).

The converter refuses a BPE tokenizer whose hash it does not know; `convert` lets such a
tokenizer through as `fallback_pre` (a known pre-tokenizer name) and keeps the
converter's own answer for every tokenizer it does know.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# argv: tree fallback_pre <converter args...>
_SHIM = """
import runpy, sys
tree, fallback = sys.argv.pop(1), sys.argv.pop(1)
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        base.logger.warning("unknown BPE pre-tokenizer hash: using %r", fallback)
        return fallback
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(tree: Path, hf_dir: Path, out: Path, outtype: str = "f16",
            fallback_pre: str = "gpt-2") -> Path:
    """Convert the HF checkpoint `hf_dir` into the GGUF file `out` (`outtype`: f16, f32, ...)."""
    subprocess.run([sys.executable, "-c", _SHIM, str(tree), fallback_pre, str(hf_dir),
                    "--outfile", str(out), "--outtype", outtype], check=True)
    return out
