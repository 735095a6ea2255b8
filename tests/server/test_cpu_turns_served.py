"""A real server (the CLI, its engine core in its own process) started with --cpu-turns
steps only in its turn: while another member of its group holds the CPUs, a request waits;
once they are free it completes, and /metrics counts the time the engine waited."""

from __future__ import annotations

import concurrent.futures
import time
import uuid

import httpx
import pytest

from engine.core.cpu_turns import CpuTurns, turns_path
from tests.support.metrics import parse, value
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.server_fixtures import ServerProcess, serving

WAIT_METRIC = "pagedserve:cpu_turns_wait_seconds_total"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    group = f"test-served-{uuid.uuid4().hex[:12]}"
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("turns"), "llama")
    args = ["--model", str(model_dir), "--served-model-name", "tiny", "--dtype", "float32",
            "--max-model-len", "256", "--port", "0", "--cpu-turns", group]
    with serving(ServerProcess(args, env={})) as server:
        yield server, group
    turns_path(group).unlink(missing_ok=True)


def _complete(url: str) -> dict:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}).json()


def _waited_s(url: str) -> float:
    return value(parse(httpx.get(url + "/metrics").text)[0], WAIT_METRIC,
                 model_name="tiny")


def test_the_server_steps_only_in_its_turn(served):
    server, group = served
    assert _complete(server.url)["usage"]["completion_tokens"] == 3  # warm, outside turns
    waited_before = _waited_s(server.url)
    other = CpuTurns(group, 0.5)  # a background member of the group: this test
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with other.turn():
            pending = pool.submit(_complete, server.url)
            time.sleep(1.0)
            assert not pending.done(), "the server stepped while another held the CPUs"
        body = pending.result(timeout=60)
    other.close()
    assert body["usage"]["completion_tokens"] == 3
    # The engine waited (most of) the second the test held the CPUs.
    assert _waited_s(server.url) - waited_before > 0.5
