"""A replica killed under load behind vllm-router, then restarted (issue 43, item 6).

Two replicas of a tiny model behind vllm-router (round robin, a health check every
second). Streams run through the router while one replica is killed (SIGKILL, its engine
core with it, as a node or an OOM kill would): every stream ends (done, or failed cleanly
with an error status or a cut stream) well inside its deadline; the router keeps serving
from the other replica; the replica restarted on the same port rejoins and serves again;
its KV-event subscriber sees the restart: the new process's replay starts at sequence 0
with AllBlocksCleared, and its live events arrive on the same subscription.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import zmq

from tests.support.kv_event_wire import DECODER, AllBlocksCleared, BlockStored, replay_from
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.reliability_fixtures import child_pids, wait_gone
from tests.support.router_fixtures import needs_router, running_router
from tests.support.server_fixtures import ServerProcess, free_port

STREAM_DEADLINE_S = 60  # far beyond a stream's time; reaching it means a hang
CHAT = {"model": "tiny", "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def start_replica(model_dir, port: int, events: dict) -> ServerProcess:
    replica = ServerProcess(
        ["--model", str(model_dir), "--served-model-name", "tiny", "--port", str(port),
         "--kv-cache-memory", "32M", "--max-model-len", "256", "--dtype", "float32",
         "--block-size", "16", "--kv-events-config", json.dumps(events)], env={})
    replica.url = replica.wait_for_url()
    return replica


def kill_replica(replica: ServerProcess) -> None:
    """SIGKILL the API server and its engine core at once."""
    pids = [replica.process.pid, *child_pids(replica.process.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    replica.process.wait(30)
    assert not wait_gone(pids)


def chats_served(replica: ServerProcess) -> int:
    return sum(1 for line in replica.lines
               if '"POST /v1/chat/completions ' in line and '" 200 ' in line)


def stream_chat(url: str, i: int) -> tuple[str, float]:
    """("done" | "error: ...", seconds) for one streamed chat through the router."""
    start = time.monotonic()
    body = {**CHAT, "stream": True,
            "messages": [{"role": "user", "content": f"story number {i}: " + "once upon a time " * 8}]}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                          timeout=STREAM_DEADLINE_S) as response:
            if response.status_code != 200:
                return f"error: HTTP {response.status_code}", time.monotonic() - start
            text = "".join(response.iter_text())
        outcome = "done" if "data: [DONE]" in text else "error: stream cut"
    except httpx.HTTPError as exc:  # the connection dropped mid-stream
        outcome = f"error: {type(exc).__name__}"
    return outcome, time.monotonic() - start


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("faults"), "llama")


@needs_router
def test_a_killed_replica_fails_cleanly_and_a_restarted_one_rejoins(model_dir):
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{free_port()}",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    survivor = start_replica(model_dir, 0, {**events, "enable_kv_cache_events": False})
    victim_port = free_port()
    victim = start_replica(model_dir, victim_port, events)
    context = zmq.Context()
    try:
        subscriber = context.socket(zmq.SUB)
        subscriber.connect(events["endpoint"])
        subscriber.setsockopt_string(zmq.SUBSCRIBE, "")
        with running_router([survivor, victim], "round_robin",
                            "--health-check-interval-secs", "1",
                            "--health-failure-threshold", "1",
                            "--health-success-threshold", "1") as url:
            with ThreadPoolExecutor(4) as pool:
                streams = [pool.submit(stream_chat, url, i) for i in range(12)]
                deadline = time.monotonic() + STREAM_DEADLINE_S
                while not httpx.get(victim.url + "/get_load").json()[0]["num_reqs"]:
                    assert time.monotonic() < deadline, "no stream reached the victim"
                    time.sleep(0.05)
                kill_replica(victim)
                outcomes = [future.result(timeout=2 * STREAM_DEADLINE_S) for future in streams]
            assert all(seconds < STREAM_DEADLINE_S for _, seconds in outcomes), outcomes
            assert all(o == "done" or o.startswith("error: ") for o, _ in outcomes)
            assert sum(o == "done" for o, _ in outcomes) >= 6, outcomes  # the survivor's

            # The router routes around the dead replica: a run of chats all answered.
            deadline = time.monotonic() + 60
            answered = 0
            while answered < 4:
                assert time.monotonic() < deadline, "the router did not route around it"
                chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                    **CHAT, "messages": [{"role": "user", "content": "still there?"}]})
                answered = answered + 1 if chat.status_code == 200 else 0

            # Restarted on the same port and event endpoints, it rejoins.
            last_seq_before = -1
            while subscriber.poll(0):
                last_seq_before = int.from_bytes(subscriber.recv_multipart()[1], "big")
            assert last_seq_before > 0  # the victim had published its blocks
            victim = start_replica(model_dir, victim_port, events)
            deadline = time.monotonic() + 60
            while chats_served(victim) == 0:
                assert time.monotonic() < deadline, "the restarted replica got no request"
                chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                    **CHAT, "messages": [{"role": "user", "content": "welcome back " * 6}]})
                assert chat.status_code == 200, chat.text
                time.sleep(0.2)

        # The subscriber learns of the restart: the new process numbers from 0, starting
        # with AllBlocksCleared (replayed, should the live one have been sent before the
        # SUB socket reconnected), and its new blocks reach the same subscription.
        replayed = replay_from(context, events["replay_endpoint"], 0)
        assert replayed[0][0] == 0 and replayed[0][1].events == [AllBlocksCleared()]
        assert replayed[-1][0] < last_seq_before + len(replayed)
        live = []
        deadline = time.monotonic() + 30
        while not any(isinstance(e, BlockStored) for _, b in live for e in b.events):
            assert time.monotonic() < deadline, "no live event from the restarted replica"
            if subscriber.poll(200):
                _, seq, payload = subscriber.recv_multipart()
                live.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        assert all(seq <= replayed[-1][0] + 10 for seq, _ in live)
    finally:
        context.destroy(linger=0)
        for replica in (survivor, victim):
            if replica.process.poll() is None:
                replica.stop()
