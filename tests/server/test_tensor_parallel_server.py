"""The server with --tensor-parallel-size 2 (a tiny Llama, gloo on the CPU): the OpenAI
API answers like one rank does; a rank killed with SIGKILL makes the engine dead
(/health 503, requests 503 engine_dead, the log names the rank and the signal) and
nothing outlives the server. Two "nodes" on 127.0.0.1 (--nnodes 2: the server with
rank 0, a second `serve --node-rank 1` with rank 1) serve together, and SIGTERM to the
server stops the engine core and both nodes' ranks within the drain timeout.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.server_fixtures import ServerProcess

SHUTDOWN_TIMEOUT_S = 5
# Waits end as soon as their condition holds; the deadline only turns a hang into a
# failure, so it is generous enough for a busy machine.
DEADLINE_S = 60
PROMPT = "The quick brown fox jumps over"


def start(model_dir, *extra: str) -> ServerProcess:
    return ServerProcess(
        ["--model", str(model_dir), "--dtype", "float32", "--port", "0",
         "--max-model-len", "128", "--kv-cache-memory", "8M", "--tensor-parallel-size", "2",
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--no-xray", *extra], env={})


@contextlib.contextmanager
def running(proc: ServerProcess):
    """The server listening; stopped (SIGINT, then SIGKILL) on leaving, even on failure."""
    try:
        proc.url = proc.wait_for_url()
        yield proc
    finally:
        proc.stop()


def pids(proc: ServerProcess) -> dict[str, int]:
    """'core', 'rank0', 'rank1' -> pid, from the log's line prefixes."""
    found = {}
    for line in proc.lines:
        if match := re.search(r"\[engine-core pid=(\d+)\]", line):
            found["core"] = int(match.group(1))
        if match := re.search(r"\[tp-rank (\d+) pid=(\d+)\]", line):
            found[f"rank{match.group(1)}"] = int(match.group(2))
    return found


def is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def wait_gone(pid_list, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(is_gone(p) for p in pid_list):
        time.sleep(0.05)
    return [p for p in pid_list if not is_gone(p)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def test_api_then_a_killed_rank_makes_the_engine_dead(model_dir):
    with LLM(str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory="8M") as llm:
        want = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True), use_tqdm=False)
    proc = start(model_dir)
    with running(proc), httpx.Client(base_url=proc.url, timeout=60) as client:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "logprobs": 2}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == want[0].outputs[0].text
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "stream": True})
        assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")

        found = pids(proc)
        assert {"core", "rank0", "rank1"} <= found.keys(), proc.lines
        killed = time.monotonic()
        os.kill(found["rank1"], signal.SIGKILL)
        while client.get("/health").status_code != 503:
            assert time.monotonic() - killed < DEADLINE_S, "the dead rank was not noticed"
            time.sleep(0.05)
        # The engine noticed in the next step or, when idle, at the next liveness probe.
        new = client.post("/v1/completions", json=body)
        assert new.status_code == 503 and new.json()["error"]["code"] == "engine_dead"
        log = "\n".join(proc.lines)
        assert re.search(r"tensor-parallel rank 1 \(pid \d+\) died: killed by signal 9 "
                         r"\(SIGKILL\)", log), log[-3000:]
    assert proc.process.returncode == 0, "\n".join(proc.lines[-30:])
    assert wait_gone(found.values(), DEADLINE_S) == []  # nothing of the engine outlives the server


def exit_code(proc: ServerProcess, timeout_s: float) -> int:
    try:
        return proc.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {timeout_s:.0f} s after SIGTERM:\n" + "\n".join(proc.lines[-40:]))


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the process group's store and the control socket)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.mark.extended
def test_two_nodes_on_loopback_then_sigterm_stops_every_rank(model_dir):
    """Node 0 (server, engine core, rank 0) and node 1 (rank 1 only) on 127.0.0.1; SIGTERM
    to the server stops both nodes' ranks within the drain timeout."""
    port = str(free_port_pair())
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    node1 = ServerProcess(
        ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "128",
         "--kv-cache-memory", "8M", "--tensor-parallel-size", "2", *nodes, "--node-rank", "1"],
        env={})
    proc = start(model_dir, *nodes, "--node-rank", "0")
    try:
        with running(proc):
            with httpx.Client(base_url=proc.url, timeout=60) as client:
                response = client.post("/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
                assert response.status_code == 200, response.text
            found = pids(proc) | {k: v for k, v in pids(node1).items() if k == "rank1"}
            assert {"core", "rank0", "rank1"} <= found.keys(), proc.lines + node1.lines
            stopped = time.monotonic()
            proc.process.send_signal(signal.SIGTERM)
            assert exit_code(proc, DEADLINE_S) == 0
            assert exit_code(node1, DEADLINE_S) == 0
            assert wait_gone(found.values(), DEADLINE_S) == []
            # Idle: nothing to drain, so well within the drain timeout on an idle machine.
            print(f"\nboth nodes' processes gone {time.monotonic() - stopped:.2f} s after SIGTERM")
    finally:
        node1.stop()
