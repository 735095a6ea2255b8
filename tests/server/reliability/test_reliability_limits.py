"""Admission control and hard caps: a full queue answers 503 with Retry-After (and
counts it), the admitted requests all complete; n, logprobs, prompts per request,
max_tokens, body size and header size are capped; a request past --request-timeout is
aborted with finish_reason "abort" and a request_timeout error.

One server for the module: the echo FakeExecutor (20 ms steps), 4 sequences running at
most, at most 8 queued.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from server.common.lifecycle import ServerLimits
from tests.support.reliability_fixtures import metric, sse_data, start_server
from tests.support.server_fixtures import build_tokenizer_dir

MAX_NUM_SEQS = 4
LIMITS = ServerLimits(max_queued_requests=8, max_n=4, max_logprobs=5,
                      max_prompts_per_request=4, max_request_body_bytes=64 << 10,
                      max_header_bytes=8 << 10, request_timeout_s=2.5)
# The request timeout applies to every request here: the other tests' requests take up to
# ~0.5 s idle (their queueing included), so 2.5 s leaves a busy machine room; the timeout
# test's requests take at least 4.6 s (230 steps of 20 ms), so the timeout always ends them.
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokenizer_dir = build_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    thread = start_server(tokenizer_dir, limits=LIMITS, max_num_seqs=MAX_NUM_SEQS,
                          max_model_len=MAX_MODEL_LEN, executor_kwargs={"step_delay_s": 0.02})
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


def assert_serving(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 3,
                                                 "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_overload_gets_503_and_the_admitted_complete(server, http):
    before = metric(http.get("/metrics").text, "request_failure_total", reason="overload")

    async def one(client: httpx.AsyncClient, i: int):
        body = {"prompt": f"Hello {i}", "max_tokens": 10, "ignore_eos": True}
        if i % 3 == 0:  # streamed: refused before the stream starts, or streamed to the end
            async with client.stream("POST", "/v1/completions",
                                     json={**body, "stream": True}) as response:
                text = (await response.aread()).decode()
                return response.status_code, response.headers, text
        response = await client.post("/v1/completions", json=body)
        return response.status_code, response.headers, response.text

    engine = server.server.state.engine

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            # The core is paused while the 48 arrive, so none is scheduled meanwhile and
            # the queue admits exactly its 8 whatever the machine's speed (a running core
            # would free queue places as it schedules, at a rate relative to the
            # arrivals that a busy machine changes).
            os.kill(engine.client.pid, signal.SIGSTOP)
            try:
                tasks = [asyncio.ensure_future(one(client, i)) for i in range(48)]
                deadline = time.monotonic() + 60  # generous: ends when all are answered
                while sum(t.done() for t in tasks) + engine.num_unfinished_requests < 48:
                    assert time.monotonic() < deadline, "the 48 requests were not all handled"
                    await asyncio.sleep(0.01)
            finally:
                os.kill(engine.client.pid, signal.SIGCONT)
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    refused = [(headers, text) for status, headers, text in results if status == 503]
    admitted = [(headers, text) for status, headers, text in results if status == 200]
    # Never more than the queue holds; exactly that many is checked last.
    assert 1 <= len(admitted) <= LIMITS.max_queued_requests, statuses
    for headers, text in refused:
        assert int(headers["retry-after"]) >= 1
        error = json.loads(text)["error"]
        assert error["code"] == "server_overloaded" and error["type"] == "server_error"
        assert "--max-queued-requests" in error["message"]
    for headers, text in admitted:
        if headers["content-type"].startswith("text/event-stream"):
            events = sse_data(text)
            assert events[-1] == "[DONE]" and '"error"' not in text
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        else:
            assert json.loads(text)["choices"][0]["finish_reason"] == "length"
    after = metric(http.get("/metrics").text, "request_failure_total", reason="overload")
    if after is not None:  # the metric exists once server/common/metrics.py counts failures
        assert after - (before or 0) == len(refused)
    assert server.server.state.lifecycle.num_queued_sequences == 0
    assert_serving(http)
    assert len(admitted) == LIMITS.max_queued_requests, statuses
    assert len(refused) == 48 - LIMITS.max_queued_requests


def test_queue_counts_sequences_and_a_big_request_still_fits_an_empty_queue(server, http):
    # n=4 is 4 queued sequences; 4 prompts x n=4 = 16 > 8, admitted into an empty queue.
    response = http.post("/v1/completions", json={
        "prompt": ["a", "b", "c", "d"], "n": 4, "max_tokens": 2, "temperature": 1.0})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 16


@pytest.mark.parametrize("body,status,param,fragment", [
    ({"prompt": "x", "n": 5}, 400, "n", "--max-n"),
    ({"prompt": "x", "n": 10**30}, 400, "n", ""),
    ({"prompt": "x", "logprobs": 6}, 400, "logprobs", "between 0 and 5"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "between 0 and 5"),
    ({"prompt": ["a"] * 5}, 400, "prompt", "--max-prompts-per-request"),
    ({"prompt": [[1]] * 5}, 400, "prompt", "--max-prompts-per-request"),
    ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", "maximum context"),
    ({"prompt": "x", "max_tokens": 2**70}, 400, "max_tokens", ""),
    ({"prompt": "x", "seed": 2**64}, 400, "seed", ""),
    ({"prompt": [2**63]}, 400, "prompt", ""),
    ({"prompt": "x", "top_p": 1e-300}, 400, "top_p", "top_p"),
])
def test_caps(http, body, status, param, fragment):
    response = http.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["param"] == param and fragment in error["message"], error
    assert_serving(http)


def test_chat_caps(http):
    base = {"messages": [{"role": "user", "content": "hi"}]}
    response = http.post("/v1/chat/completions", json={**base, "logprobs": True,
                                                       "top_logprobs": 6})
    assert response.status_code == 400 and error_of(response)["param"] == "top_logprobs"
    response = http.post("/v1/chat/completions", json={**base, "n": 5})
    assert response.status_code == 400 and error_of(response)["param"] == "n"
    # NaN and Infinity are not JSON numbers (Python's json module writes them anyway).
    for value in ("NaN", "Infinity", "-Infinity"):
        response = http.post("/v1/chat/completions", headers={"Content-Type": "application/json"},
                             content=f'{{"messages": [{{"role": "user", "content": "hi"}}], '
                                     f'"temperature": {value}}}')
        assert response.status_code == 400, response.text
        assert error_of(response)["param"] == "temperature"
    assert_serving(http)


def test_body_size_limit(http):
    big = {"prompt": "x", "stop": ["y" * 70_000]}
    response = http.post("/v1/completions", json=big)  # with Content-Length
    assert response.status_code == 413, response.text
    assert error_of(response)["code"] == "request_too_large"
    assert "--max-request-body-bytes" in error_of(response)["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "x", "stop": ["'
        for _ in range(80):
            yield b"y" * 1000
        yield b'"]}'

    response = http.post("/v1/completions", content=chunks(),
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    assert error_of(response)["code"] == "request_too_large"
    # Just under the limit is fine.
    response = http.post("/v1/completions", json={"prompt": "x", "stop": ["y" * 60_000],
                                                 "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert_serving(http)


def test_header_size_limit(server, http):
    with httpx.Client(base_url=server.url, timeout=10) as own:
        response = own.get("/v1/models", headers={"X-Big": "z" * (16 << 10)})
        assert response.status_code == 431, response.text
        assert error_of(response)["code"] == "request_header_too_large"
        # A head far beyond the limit is cut off while it arrives (uvicorn's h11 limit).
        try:
            response = own.get("/v1/models", headers={"X-Huge": "z" * (1 << 20)})
        except httpx.TransportError:
            pass  # the server may just close the connection
        else:
            assert 400 <= response.status_code < 500, response.status_code
    assert http.get("/v1/models", headers={"X-Small": "z" * 1000}).status_code == 200
    assert_serving(http)


def test_request_timeout_aborts(server, http):
    """--request-timeout 2.5 s; these requests would take at least 4.6 s."""
    body = {"prompt": "The quick brown fox", "max_tokens": 230, "ignore_eos": True,
            "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            streamed = client.post("/v1/completions", json={**body, "stream": True})
            plain = client.post("/v1/completions", json=body)
            chat = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 230,
                "ignore_eos": True, "stream": True, "n": 2})
            return await asyncio.gather(streamed, plain, chat)

    streamed, plain, chat = asyncio.run(main())
    for response in (streamed, chat):
        assert response.status_code == 200
        events = sse_data(response.text)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "request_timeout" and "2.5 s" in error["message"]
        finishes = [c["choices"][0]["finish_reason"] for c in map(json.loads, events[:-2])
                    if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finishes and set(finishes) == {"abort"}
    assert len([1 for c in map(json.loads, sse_data(chat.text)[:-2])
                if c["choices"] and c["choices"][0]["finish_reason"]]) == 2
    assert plain.status_code == 504, plain.text
    assert error_of(plain)["code"] == "request_timeout"
    engine = server.server.state.engine
    assert engine.num_unfinished_requests == 0
    assert_serving(http)
