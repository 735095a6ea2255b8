# The image of vllm-router (PyPI `vllm-router`: a Rust router in a Python wheel), for
# ./router.yaml, ./kv-aware/router.yaml and deploy/compose/router.yaml:
#
#   docker build -t vllm-router:0.1.17 -f deploy/kubernetes/router/vllm-router.Dockerfile deploy/kubernetes/router
#
# 0.1.17 is the version tests/server/test_router_interop.py runs against pagedserve.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG VLLM_ROUTER_VERSION=0.1.17
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --no-cache-dir "vllm-router==${VLLM_ROUTER_VERSION}" \
    && useradd --no-log-init --create-home --uid 1000 --user-group router
USER 1000:1000
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
CMD ["--help"]
