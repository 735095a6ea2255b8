"""Faults: an exception inside a model step fails only that step's requests (500, or an
error event then [DONE] when streaming) and the engine goes on serving; when the
engine-core process dies, /health turns 503 within a second, every waiting client gets
a 503 error instead of hanging, and the log says what happened.

One server for the module (echo FakeExecutor, 20 ms steps, 4 running at most) whose
executor, in the core process, raises inside its 10th step (`fault_steps`). The test
order matters: the fault test is the first traffic, the kill test comes last.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time

import httpx
import pytest

from tests.support.reliability_fixtures import sse_data, start_server
from tests.support.server_fixtures import build_tokenizer_dir

FAULT_STEP = 10
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokenizer_dir = build_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    thread = start_server(tokenizer_dir, max_num_seqs=MAX_NUM_SEQS,
                          executor_kwargs={"step_delay_s": 0.02, "fault_steps": [FAULT_STEP]})
    yield thread
    thread.stop()


async def _request(client: httpx.AsyncClient, i: int, max_tokens: int):
    """A request (streamed when i is even): ("ok" | "failed", status, error or None)."""
    body = {"prompt": f"The quick brown fox {i}", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    if i % 2 == 0:
        response = await client.post("/v1/completions", json={**body, "stream": True})
        events = sse_data(response.text)
        assert response.status_code == 200 and events[-1] == "[DONE]", response.text
        last = json.loads(events[-2])
        if "error" in last:
            return "failed", response.status_code, last["error"]
        assert last["choices"][0]["finish_reason"] == "length"
        return "ok", response.status_code, None
    response = await client.post("/v1/completions", json=body)
    if response.status_code == 200:
        assert response.json()["choices"][0]["finish_reason"] == "length"
        return "ok", 200, None
    return "failed", response.status_code, response.json()["error"]


# Waits in these tests end as soon as their condition holds; the deadline only turns a
# hang into a failure, so it is generous enough for a busy machine.
DEADLINE_S = 60


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_step_fault_fails_only_that_steps_requests(server, caplog):
    """8 requests, 4 run at a time, 30 tokens each: the first 4 are in step 10 and fail;
    the 4 waiting ones were not in it and complete; later requests succeed.

    The core is paused (SIGSTOP) until all 8 are in the engine, so all of them reach it
    at once: on a busy machine the 8 HTTP requests could otherwise arrive over more than
    the 10 steps (200 ms) before the fault, leaving fewer than 4 in that step."""
    engine = server.server.state.engine

    async def main(count: int, max_tokens: int, hold_core: bool = False):
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as client:
            if not hold_core:
                return await asyncio.gather(*(_request(client, i, max_tokens)
                                              for i in range(count)))
            os.kill(engine.client.pid, signal.SIGSTOP)
            try:
                pending = asyncio.gather(*(_request(client, i, max_tokens)
                                           for i in range(count)))
                await until(lambda: engine.num_unfinished_requests == count or pending.done(),
                            "the requests to reach the engine")
            finally:
                os.kill(engine.client.pid, signal.SIGCONT)
            return await pending

    results = asyncio.run(main(2 * MAX_NUM_SEQS, 30, hold_core=True))
    failed = [r for r in results if r[0] == "failed"]
    assert len(failed) == MAX_NUM_SEQS, results
    for _, status, error in failed:
        assert status in (200, 500)  # 200: streamed, the error came in-band
        assert error["code"] == "engine_error" and error["type"] == "server_error"
        assert f"injected fault in step {FAULT_STEP}" in error["message"]
    assert sum(r[0] == "ok" for r in results) == MAX_NUM_SEQS

    # The engine goes on: more traffic, all of it served.
    later = asyncio.run(main(6, 5))
    assert all(r[0] == "ok" for r in later), later
    assert httpx.get(server.url + "/health", timeout=DEADLINE_S).status_code == 200


def test_stuck_engine_core_fails_health(server):
    """/health proves the core's loop answers, not just that its process exists: a
    stopped (SIGSTOP) idle core turns /health 503 within a few seconds, and 200 again
    once it runs."""
    url = server.url
    pid = server.server.state.engine.client.pid
    assert httpx.get(url + "/health", timeout=DEADLINE_S).status_code == 200
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        # By design ~2 s (a message within 1 s counts as alive, then a 30 ms ping and a
        # 1 s grace ping); the 5 s bound leaves room for a busy machine.
        while (health := httpx.get(url + "/health", timeout=DEADLINE_S)).status_code == 200:
            assert time.monotonic() - stopped < 5, "a stuck core still looks healthy"
            time.sleep(0.1)
        detected_s = time.monotonic() - stopped
        assert health.status_code == 503, health.text
        assert health.json()["error"]["code"] == "engine_unresponsive"
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    while httpx.get(url + "/health", timeout=DEADLINE_S).status_code != 200:
        assert time.monotonic() - resumed < 5, "the resumed core was not noticed"
        time.sleep(0.05)
    response = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          timeout=DEADLINE_S)
    assert response.status_code == 200
    print(f"\nstuck core reported after {detected_s:.2f} s")


def test_engine_process_death_is_reported_fast(server, caplog):
    url = server.url
    engine = server.server.state.engine

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
            body = {"prompt": "Paged attention", "max_tokens": 200, "ignore_eos": True}
            pending = [asyncio.ensure_future(_request(client, i, 200)) for i in range(6)]
            # All six are in the engine (none can finish before 2 x 200 steps of 20 ms).
            await until(lambda: engine.num_unfinished_requests == 6
                        or any(task.done() for task in pending), "the six requests")
            assert not any(task.done() for task in pending)
            assert engine.num_unfinished_requests == 6
            killed = time.monotonic()
            os.kill(engine.client.pid, signal.SIGKILL)
            # /health turns 503 within a second.
            while (await client.get("/health")).status_code == 200:
                assert time.monotonic() - killed < 1.0, "the dead engine was not noticed"
                await asyncio.sleep(0.02)
            health_after = time.monotonic() - killed
            health = await client.get("/health")
            # Every pending client gets an error, not a hang.
            results = await asyncio.wait_for(asyncio.gather(*pending), DEADLINE_S)
            errors_after = time.monotonic() - killed
            new = await client.post("/v1/completions", json=body)
            return health, health_after, results, errors_after, new

    with caplog.at_level(logging.ERROR):
        health, health_after, results, errors_after, new = asyncio.run(main())
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    # The product's promise (module docstring). Measured on 2 cores: ~0.1 s idle, 0.14-0.2 s
    # (errors 0.19-0.26 s) with a CPU hog beside the test; the frontend polls the core's
    # liveness every 0.1 s, so these bounds leave a busy machine 5x room.
    assert health_after < 1.0 and errors_after < 2.0, (health_after, errors_after)
    for state, status, error in results:
        assert state == "failed"
        assert status in (200, 503)  # 200: streamed, the error came in-band
        assert error["code"] == "engine_dead" and "SIGKILL" in error["message"]
    assert new.status_code == 503 and new.json()["error"]["code"] == "engine_dead"
    messages = [r.getMessage() for r in caplog.records]
    assert any("engine is dead" in m and "SIGKILL" in m and "6 unfinished" in m
               for m in messages), messages
    print(f"\n/health 503 after {health_after * 1000:.0f} ms; all clients failed after "
          f"{errors_after * 1000:.0f} ms")
