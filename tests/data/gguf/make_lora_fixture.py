"""Regenerate the LoRA GGUF fixture in tests/data/gguf/ with llama.cpp's own converter.

    .venv/bin/python tests/data/gguf/make_lora_fixture.py        # seconds

Writes, for the tiny Llama of tiny-llama-Q8_0.gguf (its shapes: hidden 256, 2 layers):
    tiny-llama-lora-b8/             a random PEFT adapter (tests/support/lora_fixtures.py
                                    "b8": rank 8, alpha 16, every linear), the reference
    tiny-llama-lora-b8-F16.gguf     that adapter through llama.cpp's
                                    `convert_lora_to_gguf.py --outtype f16`

Needs llama.cpp's source tree (benchmarks/peers/setup_llamacpp.sh puts it under
~/.cache/pagedserve-peers; --llama-cpp to point elsewhere), peft, and sentencepiece (the
converter imports it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from make_fixtures import DEFAULT_TREE  # noqa: E402

BASE = HERE / "tiny-llama-Q8_0.gguf"
NAME = "b8"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, default=DEFAULT_TREE)
    args = parser.parse_args()
    from engine.model_loader.gguf import ensure_converted
    from tests.support.lora_fixtures import build_adapter

    base_dir = ensure_converted(BASE)  # config.json (+ weights) the converter reads
    with tempfile.TemporaryDirectory() as work:
        adapter = build_adapter(base_dir, Path(work), NAME, seed=7)
        out = HERE / f"tiny-llama-lora-{NAME}-F16.gguf"
        subprocess.run([sys.executable, str(args.llama_cpp / "convert_lora_to_gguf.py"),
                        "--base", str(base_dir), "--outtype", "f16", "--outfile", str(out),
                        str(adapter)], check=True)
        target = HERE / f"tiny-llama-lora-{NAME}"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        shutil.copyfile(adapter / "adapter_model.safetensors",
                        target / "adapter_model.safetensors")
        config = json.loads((adapter / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = BASE.name  # not this machine's cache path
        (target / "adapter_config.json").write_text(json.dumps(config, indent=2,
                                                               sort_keys=True) + "\n")
    print(f"wrote {out.name} ({out.stat().st_size:,} bytes) and {target.name}/")


if __name__ == "__main__":
    main()
