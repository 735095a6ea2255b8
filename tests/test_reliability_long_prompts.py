"""A busy engine stays observable: 16 concurrent prompts near max_model_len (and a few
over it) on the real model path; the over-long get 400, the rest complete, and /health
answers in under 100 ms throughout (measured). Also: hostile sampling values through
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

from tests.model_fixtures import build_tiny_checkpoint
from tests.reliability_fixtures import child_pids, pid_alive, wait_gone
from tests.server_fixtures import ServerProcess

MAX_MODEL_LEN = 512
VOCAB = 400  # the tiny tokenizer's ids; the model's embedding has 512 rows
HEALTH_LIMIT_S = 0.1


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


_PROBE = """
import json, sys, time, httpx
samples = []
try:
    with httpx.Client(base_url=sys.argv[1], timeout=5) as client:
        client.get("/health")  # connect first: measure answers, not TCP set-up
        print("ready", flush=True)
        while True:
            started = time.perf_counter()
            status = client.get("/health").status_code
            samples.append((time.time(), status, time.perf_counter() - started))
            time.sleep(0.02)
except KeyboardInterrupt:
    pass
print(json.dumps(samples), flush=True)
"""


class HealthProbe:
    """Polls /health every 20 ms from its own process (so the test's own work cannot
    delay it) until `stop()`, which returns (time.time(), status, latency) samples."""

    def __init__(self, url: str):
        self.process = subprocess.Popen([sys.executable, "-c", _PROBE, url],
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "ready"

    def stop(self) -> list[tuple[float, int, float]]:
        self.process.send_signal(signal.SIGINT)
        out, _ = self.process.communicate(timeout=30)
        return [tuple(sample) for sample in json.loads(out)]


def test_long_prompts_and_health_latency(server):
    rng = random.Random(0)
    prompts = []
    for _ in range(16):  # near the context: prefills of ~500 tokens each
        length = MAX_MODEL_LEN - 8 - rng.randrange(0, 40)
        prompts.append(([rng.randrange(3, VOCAB) for _ in range(length)], 8, "fits"))
    for excess in (4, 9, 500):  # prompt + max_tokens over the context by this much
        length = MAX_MODEL_LEN - 8 + excess
        prompts.append(([rng.randrange(3, VOCAB) for _ in range(length)], 8, "too long"))

    async def one(client, ids, max_tokens, stream):
        body = {"prompt": ids, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": stream}
        response = await client.post("/v1/completions", json=body)
        return response

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, ids, mt, i % 2 == 0)
                                          for i, (ids, mt, _) in enumerate(prompts)))

    probe = HealthProbe(server.url)
    started = time.time()
    responses = asyncio.run(main())
    elapsed = time.time() - started
    samples = probe.stop()

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
    statuses = {status for _, status, _ in samples}
    latencies = sorted(latency for _, _, latency in samples)
    assert statuses == {200}, samples
    assert len(latencies) >= 10
    worst = latencies[-1]
    p50 = latencies[len(latencies) // 2]
    print(f"\n16 long prompts in {elapsed:.1f} s; /health: {len(latencies)} probes, "
          f"p50 {p50 * 1000:.1f} ms, max {worst * 1000:.1f} ms")
    slow = [(round(t - started, 3), round(latency, 3))
            for t, _, latency in samples if latency > 0.05]
    assert worst < HEALTH_LIMIT_S, f"slow /health answers (seconds into the load, latency): {slow}"


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
