"""Per-request records and the pure arithmetic that turns them into benchmark metrics.

Nothing in this module reads a clock or does I/O: ``compute_metrics`` is a
function of the recorded timestamps and token counts only, so it can be tested
on hand-made results.

Definitions (all times in seconds in ``RequestResult``, milliseconds in the metrics):

* TTFT: ``first_token_time - start_time``.
* E2EL (end-to-end latency): ``end_time - start_time``.
* TPOT (time per output token, excluding the first):
  ``(E2EL - TTFT) / (output_tokens - 1)``, only for requests with more than
  one output token.
* ITL (inter-token latency): the gaps between successive content chunks of a
  request, pooled over all successful requests. A server that packs several
  tokens into one chunk therefore shows fewer, longer gaps.
* Percentiles use linear interpolation between closest ranks (numpy's default).
* Goodput: successful requests that met every given SLO, per second of
  benchmark duration. For the TPOT SLO a request with a single output token
  counts as TPOT 0.
* Peak concurrency: the largest number of requests (successful or not) whose
  ``[start_time, end_time)`` intervals overlap at any instant.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What the client recorded for one request (timestamps from one monotonic clock, seconds)."""

    start_time: float
    end_time: float
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    generated_text: str = ""

    @property
    def latency(self) -> float:
        return self.end_time - self.start_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.start_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; ``None`` for fewer than two tokens."""
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


@dataclass
class LatencyStats:
    """Summary of one latency distribution, in milliseconds (``None`` when there were no samples)."""

    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    count: int


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    peak_concurrency: int
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    good_requests: int | None = None
    request_goodput: float | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def latency_stats(values_s: Sequence[float]) -> LatencyStats:
    """Mean, median, p90 and p99 of ``values_s`` (seconds), reported in milliseconds."""
    if not values_s:
        return LatencyStats(mean=None, median=None, p90=None, p99=None, count=0)
    ms = [v * 1000.0 for v in values_s]
    return LatencyStats(
        mean=float(np.mean(ms)),
        median=percentile(ms, 50),
        p90=percentile(ms, 90),
        p99=percentile(ms, 99),
        count=len(ms),
    )


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Maximum number of half-open ``[start, end)`` intervals covering any single instant.

    A request that ends exactly when another starts does not overlap it.
    """
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        events.append((start, 1))
        events.append((end, -1))
    # At equal times, ends (-1) sort before starts (+1).
    events.sort()
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` into ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"invalid goodput SLO {item!r}: expected NAME:MS with NAME in {GOODPUT_METRICS}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"invalid goodput SLO {item!r}: {value!r} is not a number") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"invalid goodput SLO {item!r}: must be a positive number of ms")
        slos[name] = ms
    return slos


def meets_slos(result: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """Whether a successful request met every SLO in ``slos_ms`` (a failed one never does)."""
    if not result.success:
        return False
    for name, limit_ms in slos_ms.items():
        if name == "ttft":
            value = result.ttft
        elif name == "tpot":
            value = result.tpot if result.output_tokens >= 2 else 0.0
        elif name == "e2el":
            value = result.latency
        else:
            raise ValueError(f"unknown SLO metric {name!r}")
        if value is None or value * 1000.0 > limit_ms:
            return False
    return True


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    goodput_slos: Mapping[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregate per-request results over a benchmark that lasted ``duration`` seconds.

    Token totals, throughputs and latency distributions count successful
    requests only; peak concurrency counts every request.
    """
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)

    ttfts = [t for t in (r.ttft for r in ok) if t is not None]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itls]
    e2els = [r.latency for r in ok]

    slos = dict(goodput_slos or {})
    good = None
    goodput = None
    if slos:
        good = sum(1 for r in ok if meets_slos(r, slos))
        goodput = good / duration

    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration,
        input_throughput=total_in / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        ttft_ms=latency_stats(ttfts),
        tpot_ms=latency_stats(tpots),
        itl_ms=latency_stats(itls),
        e2el_ms=latency_stats(e2els),
        peak_concurrency=peak_concurrency((r.start_time, r.end_time) for r in results),
        goodput_slos_ms=slos,
        good_requests=good,
        request_goodput=goodput,
    )


def format_table(m: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """A fixed-width text table of the metrics."""
    width = 60
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value: object) -> None:
        if isinstance(value, float):
            text = f"{value:.2f}"
        elif value is None:
            text = "n/a"
        else:
            text = str(value)
        lines.append(f"{label:<44}{text:>{width - 44}}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    if m.goodput_slos_ms:
        row("Request goodput (req/s):", m.request_goodput)
        row("Goodput SLOs (ms):", " ".join(f"{k}:{v:g}" for k, v in m.goodput_slos_ms.items()))
    row("Input token throughput (tok/s):", m.input_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    row("Peak concurrent requests:", m.peak_concurrency)
    for name, label, stats in (
        ("TTFT", "Time to First Token", m.ttft_ms),
        ("TPOT", "Time per Output Token (excl. 1st token)", m.tpot_ms),
        ("ITL", "Inter-token Latency", m.itl_ms),
        ("E2EL", "End-to-end Latency", m.e2el_ms),
    ):
        lines.append(f"{' ' + label + ' ':-^{width}}")
        row(f"Mean {name} (ms):", stats.mean)
        row(f"Median {name} (ms):", stats.median)
        row(f"P90 {name} (ms):", stats.p90)
        row(f"P99 {name} (ms):", stats.p99)
    lines.append("=" * width)
    return "\n".join(lines)
