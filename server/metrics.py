"""Prometheus metrics: the one place where engine statistics become metric values.

`ServerMetrics` is the AsyncEngine's observer. Its two hooks are the whole contract:
  * `on_step(stats)`: once per engine-core step, with that step's `SchedulerStats`;
  * `on_request_finished(output, error)`: once per finished request (any reason),
    with its cumulative `RequestOutput` (token counts, timestamps).
Each server owns its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.outputs import SchedulerStats
from engine.request_output import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("pagedserve_num_requests_running",
                                          "Requests in the engine's running queue.")
        self.num_requests_waiting = gauge("pagedserve_num_requests_waiting",
                                          "Requests waiting for a KV-cache seat.")
        self.kv_cache_usage = gauge("pagedserve_kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (0..1).")
        self.prompt_tokens = counter("pagedserve_prompt_tokens",
                                     "Prompt tokens computed (prefill).")
        self.generation_tokens = counter("pagedserve_generation_tokens", "Tokens generated.")
        self.preemptions = counter("pagedserve_num_preemptions", "Requests preempted.")
        self.prefix_cache_queries = counter("pagedserve_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("pagedserve_prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self._request_success = Counter(
            "pagedserve_request_success", "Finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self.e2e_latency = histogram("pagedserve_e2e_request_latency_seconds",
                                     "Arrival to finish.", _LATENCY_BUCKETS)
        self.time_to_first_token = histogram("pagedserve_time_to_first_token_seconds",
                                             "Arrival to first token.", _LATENCY_BUCKETS)
        self.queue_time = histogram("pagedserve_request_queue_time_seconds",
                                    "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("pagedserve_request_prompt_tokens",
                                               "Prompt length per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "pagedserve_request_generation_tokens", "Generated tokens per request.",
            _TOKEN_BUCKETS)

    # ---------------------------------------------------------------- hooks
    def on_step(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)

    def on_request_finished(self, output: RequestOutput, error: str | None) -> None:
        reasons = {o.finish_reason for o in output.outputs if o.finish_reason}
        reason = "error" if error else (sorted(reasons)[0] if reasons else "abort")
        self._request_success.labels(self._model_name, reason).inc()
        m = output.metrics
        if m.finished_time is not None:
            self.e2e_latency.observe(max(0.0, m.finished_time - m.arrival_time))
        if m.first_token_time is not None:
            self.time_to_first_token.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        self.request_prompt_tokens.observe(output.num_prompt_tokens)
        self.request_generation_tokens.observe(output.num_generation_tokens)

    # ---------------------------------------------------------------- export
    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
