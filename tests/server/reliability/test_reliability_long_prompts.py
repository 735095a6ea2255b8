"""A busy engine stays observable: 16 concurrent prompts near max_model_len (and a few
over it) on the real model path; the over-long get 400, the rest complete, and /health
stays fast throughout (20 answers measured under the load: median under 100 ms, none
over 1 s; see HEALTH_P50_LIMIT_S). Also: hostile sampling values through
the real sampler never fail a step, and SIGTERM stops the CLI server cleanly (exit 0,
no child process left).

The server is the CLI (`python -m server serve`) over a tiny random Llama checkpoint
with a 512-token context, so long prompts make multi-chunk prefills of real compute.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.reliability_fixtures import child_pids, metric, pid_alive, wait_gone
from tests.support.server_fixtures import ServerProcess

MAX_MODEL_LEN = 512
VOCAB = 400  # the tiny tokenizer's ids; the model's embedding has 512 rows
# /health under the load of 16 long prefills (20 samples, taken while it lasts).
# Measured on a 2-core machine: p50 6 ms, max 27 ms idle; p50 9-13 ms, max 56-102 ms
# with one CPU hog beside the server. The typical answer (the median) must stay under
# 100 ms: a /health queued behind model work would wait for steps (up to ~0.1 s each
# here idle, longer on a busy machine) or for the whole load (0.6-2.6 s). A single
# answer may be delayed by the OS scheduler when the machine is oversubscribed (two
# cores, the engine core computing, the frontend streaming, other jobs), so the worst
# one gets 1 s, still well under the time the load takes on a busy machine.
HEALTH_P50_LIMIT_S = 0.1
HEALTH_MAX_LIMIT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint: Path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama",
                                             max_position_embeddings=MAX_MODEL_LEN)
    proc = ServerProcess(
        ["--model", str(checkpoint), "--port", "0", "--kv-cache-memory", "64M",
         "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32"],
        env={"PAGEDSERVE_LOG_LEVEL": "info", "PAGEDSERVE_SHUTDOWN_TIMEOUT": "5"})
    try:
        proc.url = proc.wait_for_url()
    except BaseException:
        proc.stop()
        raise
    proc.children = child_pids(proc.process.pid)
    yield proc
    if proc.process.poll() is None:
        proc.stop()


NUM_HEALTH_SAMPLES = 20

_PROBE = """
import json, sys, time, httpx
count = int(sys.argv[2])
samples = []
with httpx.Client(base_url=sys.argv[1], timeout=60) as client:
    client.get("/health")  # connect first: measure answers, not TCP set-up
    print("ready", flush=True)
    sys.stdin.readline()  # "go": the load is running
    for _ in range(count):
        started = time.perf_counter()
        status = client.get("/health").status_code
        samples.append((time.time(), status, time.perf_counter() - started))
        time.sleep(0.02)
print(json.dumps(samples), flush=True)
"""


class HealthProbe:
    """Takes `count` /health samples, 20 ms apart, from its own process (so the test's
    own work cannot delay it) once `go()` is called; `result()` waits for them:
    (time.time(), status, latency) each. A fixed count, not a wall-clock window: how
    many fit into the load must not depend on how fast the machine is."""

    def __init__(self, url: str, count: int):
        self.process = subprocess.Popen([sys.executable, "-c", _PROBE, url, str(count)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        assert self.process.stdout.readline().strip() == "ready"

    def go(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def done(self) -> bool:
        return self.process.poll() is not None

    def result(self) -> list[tuple[float, int, float]]:
        out, _ = self.process.communicate(timeout=600)
        assert self.process.returncode == 0, out
        return [tuple(sample) for sample in json.loads(out)]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def long_prompt(rng: random.Random) -> list[int]:
    """A prompt near the context: a prefill of ~500 tokens."""
    return [rng.randrange(3, VOCAB) for _ in range(MAX_MODEL_LEN - 8 - rng.randrange(0, 40))]


def test_long_prompts_and_health_latency(server):
    rng = random.Random(0)
    prompts = []
    for _ in range(16):  # near the context: prefills of ~500 tokens each
        prompts.append((long_prompt(rng), 8, "fits"))
    for excess in (4, 9, 500):  # prompt + max_tokens over the context by this much
        length = MAX_MODEL_LEN - 8 + excess
        prompts.append(([rng.randrange(3, VOCAB) for _ in range(length)], 8, "too long"))

    async def one(client, ids, max_tokens, stream):
        body = {"prompt": ids, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": stream}
        response = await client.post("/v1/completions", json=body)
        return response

    async def busy(client) -> bool:
        text = (await client.get("/metrics")).text
        return any(metric(text, name) for name in ("num_requests_running",
                                                   "num_requests_waiting"))

    async def worker(client, i: int, ids, max_tokens, kind):
        """Prompt `i`; then, for the 16 that fit, long prompts one after another until the
        probe has all its samples: the load lasts as long as the measuring, however slow
        the machine is, and stays at 16 concurrent long prompts."""
        first = await one(client, ids, max_tokens, i % 2 == 0)
        extra = []
        while kind == "fits" and not probe.done():
            ids = long_prompt(random.Random(i * 1000 + len(extra)))
            extra.append(await one(client, ids, 8, False))
        return first, extra

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            load = asyncio.gather(*(worker(client, i, *prompt)
                                    for i, prompt in enumerate(prompts)))
            deadline = time.monotonic() + 300
            while not await busy(client):  # the engine has the load: start measuring
                assert time.monotonic() < deadline and not load.done(), "no load seen"
                await asyncio.sleep(0.01)
            probe.go()
            return await load

    probe = HealthProbe(server.url, NUM_HEALTH_SAMPLES)
    try:
        started = time.time()
        results = asyncio.run(main())
        elapsed = time.time() - started
        samples = probe.result()
    finally:
        probe.kill()

    responses = [first for first, _ in results]
    extra = [response for _, more in results for response in more]
    for (_, _, kind), response in zip(prompts, responses, strict=True):
        if kind == "too long":
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded", error
            continue
        assert response.status_code == 200, response.text
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n")
            assert '"error"' not in response.text
            tokens = sum(len(json.loads(line[6:]).get("choices", [{}])[0].get("text", ""))
                         for line in response.text.split("\n\n")
                         if line.startswith("data: {"))
            assert tokens > 0
        else:
            assert response.json()["usage"]["completion_tokens"] == 8
    for response in extra:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
    statuses = {status for _, status, _ in samples}
    latencies = sorted(latency for _, _, latency in samples)
    assert statuses == {200}, samples
    assert len(latencies) == NUM_HEALTH_SAMPLES
    worst = latencies[-1]
    p50 = latencies[len(latencies) // 2]
    print(f"\n16 long prompts (+{len(extra)} more to keep the load up) in {elapsed:.1f} s; "
          f"/health: {len(latencies)} probes, p50 {p50 * 1000:.1f} ms, "
          f"max {worst * 1000:.1f} ms")
    slow = [(round(t - started, 3), round(latency, 3))
            for t, _, latency in samples if latency > 0.05]
    assert p50 < HEALTH_P50_LIMIT_S and worst < HEALTH_MAX_LIMIT_S, \
        f"slow /health answers (seconds into the load, latency): {slow}"


HOSTILE_SAMPLING = [
    {"temperature": 1e308}, {"temperature": 1e-300}, {"repetition_penalty": 1e-300},
    {"repetition_penalty": 1e300}, {"top_k": 2**62}, {"top_k": -1}, {"min_p": 1.0},
    {"top_p": 1e-30}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"min_tokens": 2**62},
    {"logit_bias": {str(i): -100 for i in range(512)}}, {"logit_bias": {"3": 100}},
    {"presence_penalty": 2, "frequency_penalty": -2}, {"stop": [""]},
    {"stop_token_ids": [2**63 - 1, -(2**63)]}, {"logprobs": 20},
    {"repetition_penalty": 1e-300, "logprobs": 5},
]


def test_hostile_sampling_values_never_fail_a_step(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(
                client.post("/v1/completions", json={"prompt": "Hello, world!",
                                                     "max_tokens": 4, **extra})
                for extra in HOSTILE_SAMPLING))

    for extra, response in zip(HOSTILE_SAMPLING, asyncio.run(main()), strict=True):
        assert response.status_code in (200, 400), (extra, response.text)
        json.loads(response.text)  # strict JSON: no NaN or Infinity
        assert "NaN" not in response.text and "Infinity" not in response.text


def test_sigterm_stops_the_cli_server_cleanly(server):
    assert server.children and all(pid_alive(pid) for pid in server.children)
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(30)
    assert code == 0, "\n".join(server.lines[-30:])
    assert not wait_gone(server.children)
    assert any("server stopped" in line for line in server.lines)
