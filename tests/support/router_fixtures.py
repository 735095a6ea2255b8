"""vllm-router (PyPI `vllm-router`, its Rust binary) in front of test replicas.

    with running_router([replica_a, replica_b], "cache_aware", *extra_flags) as url: ...

The binary and its start-up are tests/support/router_deploy.py's (which the deployment tests
use against fake workers); this adds the arguments for real replicas.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.support import router_deploy
from tests.support.server_fixtures import free_port

ROUTER = router_deploy.router_binary()
needs_router = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed")


@contextlib.contextmanager
def running_router(replicas, policy: str, *extra: str):
    args = ["--host", "127.0.0.1", "--port", str(free_port()), "--policy", policy,
            "--prometheus-port", str(free_port()), "--worker-urls",
            *[r.url for r in replicas], "--log-level", "warning", *extra]
    # /v1/models answers once the router has found the replicas healthy.
    with router_deploy.running_router(ROUTER, args, timeout=180,
                                      ready_path="/v1/models") as url:
        yield url
