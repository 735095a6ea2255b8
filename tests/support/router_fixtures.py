"""vllm-router (PyPI `vllm-router`, its Rust binary) in front of test replicas.

    with running_router([replica_a, replica_b], "cache_aware", *extra_flags) as url: ...
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sysconfig
import time

import httpx
import pytest

from tests.support.server_fixtures import free_port

# The binary the [test] extra installs beside this interpreter (PATH may not hold it).
ROUTER = shutil.which("vllm-router", path=sysconfig.get_path("scripts")) or shutil.which(
    "vllm-router")
needs_router = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed")


@contextlib.contextmanager
def running_router(replicas, policy: str, *extra: str):
    port = free_port()
    proc = subprocess.Popen(
        [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
         "--prometheus-port", str(free_port()), "--worker-urls",
         *[r.url for r in replicas], "--log-level", "warning", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # it waits for both replicas to be healthy
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
