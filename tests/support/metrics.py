"""Metrics test helpers: parse an exposition, wait for a condition, the tiny metrics server.

Shared by tests/server/test_metrics.py, test_api_server_count.py and
tests/deploy/test_prometheus_live.py.
"""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.server_fixtures import ServerProcess

MODEL = "tiny"


BLOCK_SIZE = 16


NUM_BLOCKS = 32  # 512 tokens: enough for the sequential tests, preemption under a burst


MAX_MODEL_LEN = 256


FORCED_TOKEN = 300  # logit_bias makes greedy decoding emit it; as a stop token it ends "stop"


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """(sample name, sorted labels) -> value, and family name -> type."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        v for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == want for k, want in labels.items())
    )


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def p(name: str) -> str:
    return "pagedserve:" + name


def tiny_metrics_server(tmp_path_factory, *extra_args: str) -> ServerProcess:
    """The tiny Llama served with a small KV cache (also used by test_prometheus_live)."""
    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    return ServerProcess(
        ["--model", str(checkpoint), "--port", "0", "--served-model-name", MODEL,
         "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
         "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", *extra_args],
        env={"PAGEDSERVE_LOG_LEVEL": "info"})


def scrape(url: str, **headers: str) -> Samples:
    response = httpx.get(url + "/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    return parse(response.text)[0]


def wait_until(predicate, timeout_s: float = 60.0, what: str = "condition",
               poll_s: float = 0.05):
    """predicate()'s first truthy result, polling every `poll_s`; AssertionError at timeout.

    The timeout only turns a hang into a failure: polls end as soon as the condition
    holds, so it is generous enough for a busy machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def wait_idle(url: str) -> Samples:
    """The metrics once the engine reports no request and no KV block in use."""
    def idle():
        samples = scrape(url)
        busy = (value(samples, p("num_requests_running")),
                value(samples, p("num_requests_waiting")),
                value(samples, p("kv_cache_usage_perc")))
        return samples if busy == (0, 0, 0) else None

    return wait_until(idle, what="running = waiting = 0 and KV usage = 0")
