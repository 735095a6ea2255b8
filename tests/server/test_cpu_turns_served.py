"""A real server started with --cpu-turns steps only in its turn: while another member of
its group holds the CPUs, a request waits; once they are free it completes."""

from __future__ import annotations

import concurrent.futures
import time
import uuid

import httpx
import pytest

from engine.core.cpu_turns import CpuTurns, turns_path
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.server_fixtures import start_model_server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    group = f"test-served-{uuid.uuid4().hex[:12]}"
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("turns"), "llama")
    thread = start_model_server(model_dir, "--dtype", "float32", "--max-model-len", "256",
                                "--cpu-turns", group)
    yield thread, group
    thread.stop()
    turns_path(group).unlink(missing_ok=True)


def _complete(url: str) -> dict:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}).json()


def test_the_server_steps_only_in_its_turn(served):
    server, group = served
    assert _complete(server.url)["usage"]["completion_tokens"] == 3  # warm, outside turns
    other = CpuTurns(group, 0.5)  # a background member of the group: this test
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with other.turn():
            pending = pool.submit(_complete, server.url)
            time.sleep(1.0)
            assert not pending.done(), "the server stepped while another held the CPUs"
        body = pending.result(timeout=60)
    assert body["usage"]["completion_tokens"] == 3
    other.close()
