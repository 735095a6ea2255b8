"""Tests for the serving benchmark client (benchmarks/serve.py, datasets.py, metrics.py).

1. Metric arithmetic on hand-made timestamps (exact expected values).
2. Arrival-process properties.
3. Short live runs against a fake OpenAI-compatible streaming server on 127.0.0.1.

``FakeOpenAIServer`` and ``run_bench`` are written to be reused: ``run_bench``
takes any base URL, so a live run against the real pagedserve server only needs
a different server fixture.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks import serve
from benchmarks.datasets import (
    SampleRequest,
    count_tokens,
    jsonl_dataset,
    load_tokenizer,
    prefix_dataset,
    random_dataset,
    sample_lengths,
)
from benchmarks.metrics import (
    RequestResult,
    compute_metrics,
    format_table,
    meets_slos,
    parse_goodput,
    peak_concurrency,
    percentile,
)
from tests.support.bench import run_bench

# ---------------------------------------------------------------------------
# Tiny offline tokenizer: words "w3".."w199", whitespace-separated, one token each.
# ---------------------------------------------------------------------------

TINY_VOCAB_SIZE = 200


def build_tiny_tokenizer(directory: Path) -> Path:
    """Save a word-level tokenizer (no downloads) that ``load_tokenizer`` can read back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, TINY_VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path) -> Any:
    return load_tokenizer(str(tiny_tokenizer_dir))


# ---------------------------------------------------------------------------
# 1. Metric arithmetic
# ---------------------------------------------------------------------------


def _recorded_results() -> list[RequestResult]:
    """Four requests with hand-picked timelines (seconds)."""
    return [
        # ttft 0.1, e2el 0.5, tpot (0.5-0.1)/4 = 0.1, itl [0.1, 0.2]
        RequestResult(
            start_time=0.0,
            first_token_time=0.1,
            chunk_times=[0.1, 0.2, 0.4],
            end_time=0.5,
            prompt_tokens=10,
            output_tokens=5,
            success=True,
        ),
        # ttft 0.3, e2el 0.6, tpot (0.6-0.3)/2 = 0.15, itl [0.1]
        RequestResult(
            start_time=0.2,
            first_token_time=0.5,
            chunk_times=[0.5, 0.6],
            end_time=0.8,
            prompt_tokens=20,
            output_tokens=3,
            success=True,
        ),
        # ttft 0.05, e2el 0.1, one output token: no tpot, no itl
        RequestResult(
            start_time=0.3,
            first_token_time=0.35,
            chunk_times=[0.35],
            end_time=0.4,
            prompt_tokens=5,
            output_tokens=1,
            success=True,
        ),
        # failed: counted in peak concurrency only
        RequestResult(
            start_time=0.45,
            end_time=0.9,
            prompt_tokens=7,
            success=False,
            error="HTTP 500",
        ),
    ]


def test_request_result_derived_values() -> None:
    r1, r2, r3, r4 = _recorded_results()
    assert r1.ttft == pytest.approx(0.1)
    assert r1.latency == pytest.approx(0.5)
    assert r1.tpot == pytest.approx(0.1)
    assert r1.itls == pytest.approx([0.1, 0.2])
    assert r2.tpot == pytest.approx(0.15)
    assert r3.tpot is None and r3.itls == []
    assert r4.ttft is None and r4.tpot is None


def test_compute_metrics_exact_values() -> None:
    m = compute_metrics(_recorded_results(), duration=2.0, goodput_slos=None)
    assert m.completed == 3
    assert m.failed == 1
    assert m.duration_s == 2.0
    assert m.total_input_tokens == 35
    assert m.total_output_tokens == 9
    assert m.request_throughput == pytest.approx(1.5)
    assert m.input_throughput == pytest.approx(17.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(22.0)
    assert m.peak_concurrency == 3

    # TTFT ms [100, 300, 50] -> sorted [50, 100, 300]; p90 rank 1.8 -> 100 + 0.8*200.
    assert m.ttft_ms.count == 3
    assert m.ttft_ms.mean == pytest.approx(150.0)
    assert m.ttft_ms.median == pytest.approx(100.0)
    assert m.ttft_ms.p90 == pytest.approx(260.0)
    assert m.ttft_ms.p99 == pytest.approx(296.0)
    # TPOT ms [100, 150]
    assert m.tpot_ms.count == 2
    assert m.tpot_ms.mean == pytest.approx(125.0)
    assert m.tpot_ms.median == pytest.approx(125.0)
    assert m.tpot_ms.p90 == pytest.approx(145.0)
    assert m.tpot_ms.p99 == pytest.approx(149.5)
    # ITL ms [100, 200, 100] -> sorted [100, 100, 200]
    assert m.itl_ms.count == 3
    assert m.itl_ms.mean == pytest.approx(400.0 / 3)
    assert m.itl_ms.median == pytest.approx(100.0)
    assert m.itl_ms.p90 == pytest.approx(180.0)
    assert m.itl_ms.p99 == pytest.approx(198.0)
    # E2EL ms [500, 600, 100] -> sorted [100, 500, 600]
    assert m.e2el_ms.count == 3
    assert m.e2el_ms.mean == pytest.approx(400.0)
    assert m.e2el_ms.median == pytest.approx(500.0)
    assert m.e2el_ms.p90 == pytest.approx(580.0)
    assert m.e2el_ms.p99 == pytest.approx(598.0)

    assert m.goodput_slos_ms == {}
    assert m.good_requests is None and m.request_goodput is None


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 200.0}, 2),  # r1 (100) and r3 (50); r2 is 300
        ({"ttft": 200.0, "tpot": 120.0}, 2),  # r3 has one token: tpot counts as 0
        ({"tpot": 120.0}, 2),  # r2's tpot is 150
        ({"tpot": 150.5}, 3),
        ({"ttft": 200.0, "e2el": 400.0}, 1),  # only r3 (100 ms e2el)
        ({"e2el": 10_000.0, "ttft": 10_000.0, "tpot": 10_000.0}, 3),  # failed r4 never counts
        ({"ttft": 1.0}, 0),
    ],
)
def test_goodput(slos: dict[str, float], good: int) -> None:
    m = compute_metrics(_recorded_results(), duration=2.0, goodput_slos=slos)
    assert m.good_requests == good
    assert m.request_goodput == pytest.approx(good / 2.0)
    assert m.goodput_slos_ms == slos


def test_slo_limits_are_inclusive() -> None:
    # Binary-exact times: ttft 0.25 s, e2el 0.75 s, tpot (0.75 - 0.25) / 2 = 0.25 s.
    r = RequestResult(
        start_time=1.0,
        first_token_time=1.25,
        chunk_times=[1.25, 1.5, 1.75],
        end_time=1.75,
        output_tokens=3,
        success=True,
    )
    assert meets_slos(r, {"ttft": 250.0, "tpot": 250.0, "e2el": 750.0})
    assert not meets_slos(r, {"ttft": 249.0})
    assert not meets_slos(r, {"tpot": 249.0})
    assert not meets_slos(r, {"e2el": 749.0})


def test_compute_metrics_all_failed() -> None:
    results = [
        RequestResult(start_time=0.0, end_time=1.0, success=False, error="boom"),
        RequestResult(start_time=0.5, end_time=1.5, success=False, error="boom"),
    ]
    m = compute_metrics(results, duration=1.5, goodput_slos={"ttft": 100.0})
    assert (m.completed, m.failed) == (0, 2)
    assert m.request_throughput == 0.0 and m.output_throughput == 0.0
    assert m.ttft_ms.mean is None and m.ttft_ms.count == 0
    assert m.itl_ms.p99 is None
    assert m.good_requests == 0 and m.request_goodput == 0.0
    assert m.peak_concurrency == 2
    assert "n/a" in format_table(m)


def test_compute_metrics_rejects_nonpositive_duration() -> None:
    with pytest.raises(ValueError):
        compute_metrics([], duration=0.0)


@pytest.mark.parametrize(
    ("intervals", "peak"),
    [
        ([], 0),
        ([(0.0, 1.0)], 1),
        ([(0.0, 1.0), (1.0, 2.0)], 1),  # touching intervals do not overlap
        ([(0.0, 1.0), (0.0, 1.0)], 2),
        ([(0.0, 2.0), (1.0, 3.0), (1.5, 1.6), (2.5, 4.0)], 3),
        ([(3.0, 4.0), (0.0, 10.0), (1.0, 2.0), (3.5, 3.6), (9.0, 9.5)], 3),
    ],
)
def test_peak_concurrency(intervals: list[tuple[float, float]], peak: int) -> None:
    assert peak_concurrency(intervals) == peak


def test_percentile_linear_interpolation() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_parse_goodput() -> None:
    assert parse_goodput(None) == {}
    assert parse_goodput(["ttft:500", "TPOT:50.5", "e2el:2000"]) == {
        "ttft": 500.0,
        "tpot": 50.5,
        "e2el": 2000.0,
    }
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:-1"], ["ttft:0"], ["ttft:inf"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_format_table_mentions_every_metric() -> None:
    m = compute_metrics(_recorded_results(), duration=2.0, goodput_slos={"ttft": 200.0})
    table = format_table(m)
    for needle in (
        "Successful requests",
        "Failed requests",
        "Request goodput",
        "Peak concurrent",
        "Mean TTFT",
        "P99 TPOT",
        "Median ITL",
        "P90 E2EL",
        "Output token throughput",
    ):
        assert needle in table


# ---------------------------------------------------------------------------
# Request bodies and stream chunks
# ---------------------------------------------------------------------------


def test_build_payload() -> None:
    sample = SampleRequest(prompt="w3 w4", prompt_len=2, max_tokens=7)
    body = serve.build_payload("completions", "m", sample, temperature=0.0)
    assert body == {
        "model": "m",
        "prompt": "w3 w4",
        "max_tokens": 7,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chat = serve.build_payload(
        "chat", "m", sample, ignore_eos=False, top_p=0.9, extra_body={"temperature": 0.5, "x": 1}
    )
    assert chat["messages"] == [{"role": "user", "content": "w3 w4"}]
    assert "prompt" not in chat and "ignore_eos" not in chat
    assert chat["top_p"] == 0.9 and chat["temperature"] == 0.5 and chat["x"] == 1


def test_parse_chunk() -> None:
    assert serve.parse_chunk({"choices": [{"text": "ab"}]}, "completions") == ("ab", None)
    role_only = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    assert serve.parse_chunk(role_only, "chat") == ("", None)
    content = {"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}
    assert serve.parse_chunk(content, "chat") == ("hi", None)
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    assert serve.parse_chunk({"choices": [], "usage": usage}, "chat") == ("", usage)
    with pytest.raises(RuntimeError, match="overloaded"):
        serve.parse_chunk({"error": {"message": "overloaded"}}, "completions")
    with pytest.raises(RuntimeError, match="bad"):
        serve.parse_chunk({"error": "bad"}, "chat")


def test_api_root() -> None:
    assert serve.api_root("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert serve.api_root("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000"
    assert serve.api_root("http://h/v1/") == "http://h"


# ---------------------------------------------------------------------------
# 2. Arrival process
# ---------------------------------------------------------------------------


def test_arrivals_infinite_rate_all_at_once() -> None:
    assert serve.arrival_times(5, math.inf).tolist() == [0.0] * 5
    assert serve.arrival_times(0, 3.0).tolist() == []


def test_arrivals_seeded_and_monotonic() -> None:
    a = serve.arrival_times(100, 4.0, 1.0, seed=7)
    b = serve.arrival_times(100, 4.0, 1.0, seed=7)
    c = serve.arrival_times(100, 4.0, 1.0, seed=8)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a[0] == 0.0
    assert np.all(np.diff(a) >= 0)


@pytest.mark.parametrize(("rate", "burstiness"), [(10.0, 1.0), (2.5, 0.5), (40.0, 4.0)])
def test_arrivals_mean_and_dispersion(rate: float, burstiness: float) -> None:
    gaps = np.diff(serve.arrival_times(40_001, rate, burstiness, seed=123))
    # Gamma(shape k, mean 1/rate): mean 1/rate, squared coefficient of variation 1/k.
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.03)
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1.0 / burstiness, rel=0.08)


@pytest.mark.parametrize(
    "kwargs", [{"request_rate": 0.0}, {"request_rate": 1.0, "burstiness": 0.0}]
)
def test_arrivals_reject_bad_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        serve.arrival_times(3, **kwargs)


# ---------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------


def test_sample_lengths_range() -> None:
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 1000, 100, 0.25)
    assert lens.min() >= 75 and lens.max() <= 125
    assert lens.min() < 80 and lens.max() > 120  # covers the range
    assert sample_lengths(rng, 5, 10, 0.0).tolist() == [10] * 5
    with pytest.raises(ValueError):
        sample_lengths(rng, 5, 10, 1.0)


def test_random_dataset(tiny_tokenizer: Any) -> None:
    samples = random_dataset(
        tiny_tokenizer, 20, input_len=32, output_len=8, range_ratio=0.5, seed=3
    )
    assert len(samples) == 20
    for s in samples:
        assert 16 <= s.prompt_len <= 48
        assert 4 <= s.max_tokens <= 12
        assert count_tokens(tiny_tokenizer, s.prompt) == s.prompt_len
        assert "<s>" not in s.prompt and "[UNK]" not in s.prompt
    again = random_dataset(tiny_tokenizer, 20, input_len=32, output_len=8, range_ratio=0.5, seed=3)
    assert again == samples
    other = random_dataset(tiny_tokenizer, 20, input_len=32, output_len=8, range_ratio=0.5, seed=4)
    assert other != samples
    fixed = random_dataset(tiny_tokenizer, 4, input_len=10, output_len=3, seed=0)
    assert [(s.prompt_len, s.max_tokens) for s in fixed] == [(10, 3)] * 4


def test_prefix_dataset(tiny_tokenizer: Any) -> None:
    samples = prefix_dataset(
        tiny_tokenizer,
        num_prompts=12,
        num_prefixes=3,
        prefix_len=20,
        suffix_len=4,
        output_len=5,
        seed=1,
    )
    assert len(samples) == 12
    prefixes = {s.prompt.split("\n")[0] for s in samples}
    assert len(prefixes) == 3
    assert all(count_tokens(tiny_tokenizer, p) == 20 for p in prefixes)
    assert len({s.prompt for s in samples}) == 12  # suffixes make every prompt unique
    assert all(s.prompt_len == 24 and s.max_tokens == 5 for s in samples)


def test_jsonl_dataset(tmp_path: Path, tiny_tokenizer: Any) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "w3 w4 w5", "max_tokens": 2}\n\n{"prompt": "w6"}\n')
    samples = jsonl_dataset(
        str(path), num_prompts=None, default_max_tokens=9, tokenizer=tiny_tokenizer
    )
    assert samples == [SampleRequest("w3 w4 w5", 3, 2), SampleRequest("w6", 1, 9)]
    cycled = jsonl_dataset(str(path), num_prompts=3, default_max_tokens=9)
    assert [s.prompt for s in cycled] == ["w3 w4 w5", "w6", "w3 w4 w5"]
    assert cycled[0].prompt_len == 0  # no tokenizer: the server's usage fills it in
    for bad in ('{"max_tokens": 2}\n', '{"prompt": "x", "max_tokens": 0}\n', "not json\n", ""):
        path.write_text(bad)
        with pytest.raises(ValueError):
            jsonl_dataset(str(path), num_prompts=None, default_max_tokens=9)


# ---------------------------------------------------------------------------
# 3. Live runs against a fake OpenAI-compatible streaming server
# ---------------------------------------------------------------------------


class FakeOpenAIServer:
    """A streaming OpenAI-compatible server (FastAPI + uvicorn in a thread) on 127.0.0.1.

    Each request streams ``max_tokens`` content chunks ("w7 " each, one token of
    the tiny tokenizer) ``chunk_delay`` seconds apart, then a usage chunk (unless
    ``report_usage`` is false) and ``[DONE]``. Failures on purpose:

    * the n-th request received (1-based) for n in ``fail_request_numbers``,
      or one whose prompt contains ``fail_marker``: HTTP 500 before streaming;
    * a prompt containing ``stream_error_marker``: one chunk, then an error chunk.

    ``requests`` holds every JSON body received, ``peak_in_flight`` the most
    requests the server was handling at once.
    """

    def __init__(
        self,
        *,
        chunk_delay: float = 0.005,
        report_usage: bool = True,
        fail_request_numbers: tuple[int, ...] = (),
        fail_marker: str = "FAIL_HTTP",
        stream_error_marker: str = "FAIL_STREAM",
        model_id: str = "fake-model",
    ) -> None:
        self.chunk_delay = chunk_delay
        self.report_usage = report_usage
        self.fail_request_numbers = set(fail_request_numbers)
        self.fail_marker = fail_marker
        self.stream_error_marker = stream_error_marker
        self.model_id = model_id
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.base_url = ""

    def _app(self) -> Any:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_id, "object": "model"}]}

        async def handle(request: Request, chat: bool) -> Any:
            body = await request.json()
            self.requests.append(body)
            number = len(self.requests)
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            if number in self.fail_request_numbers or self.fail_marker in prompt:
                return JSONResponse({"error": {"message": "failed on purpose"}}, status_code=500)
            n = int(body.get("max_tokens", 16))
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            stream_error = self.stream_error_marker in prompt

            def chunk(text: str) -> str:
                if chat:
                    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
                    obj = {"object": "chat.completion.chunk", "choices": [choice]}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": None}
                    obj = {"object": "text_completion", "choices": [choice]}
                return f"data: {json.dumps(obj)}\n\n"

            async def events() -> Any:
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                try:
                    if chat:  # a role-only first delta, as real servers send
                        first = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
                        yield f"data: {json.dumps(first)}\n\n"
                    for i in range(n):
                        await asyncio.sleep(self.chunk_delay)
                        yield chunk("w7 ")
                        if stream_error and i == 0:
                            yield 'data: {"error": {"message": "broke mid-stream"}}\n\n'
                            return
                    if self.report_usage and include_usage:
                        usage = {
                            "prompt_tokens": len(prompt.split()),
                            "completion_tokens": n,
                            "total_tokens": len(prompt.split()) + n,
                        }
                        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self.in_flight -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Any:
            return await handle(request, chat=True)

        return app

    def __enter__(self) -> FakeOpenAIServer:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 60.0  # generous: a poll, not a bound
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        assert self._thread is not None
        self._thread.join(timeout=10.0)


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[FakeOpenAIServer]:
    """A running ``FakeOpenAIServer``; pass options with
    ``@pytest.mark.parametrize("fake_server", [{...}], indirect=True)``."""
    with FakeOpenAIServer(**getattr(request, "param", {})) as server:
        yield server






@pytest.mark.parametrize("fake_server", [{"fail_request_numbers": (3,)}], indirect=True)
def test_live_random_completions(
    fake_server: FakeOpenAIServer, tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    result_file = tmp_path / "out" / "result.json"
    rc = serve.main(
        [
            "--base-url",
            fake_server.base_url + "/v1",
            "--tokenizer",
            str(tiny_tokenizer_dir),
            "--dataset",
            "random",
            "--num-prompts",
            "8",
            "--random-input-len",
            "12",
            "--random-output-len",
            "4",
            "--max-concurrency",
            "3",
            "--seed",
            "5",
            "--goodput",
            "e2el:60000",
            "--result-file",
            str(result_file),
            "--save-detailed",
            "--disable-tqdm",
            "--label",
            "fake",
        ]
    )
    assert rc == 0
    record = json.loads(result_file.read_text())
    m = record["metrics"]
    assert (m["completed"], m["failed"]) == (7, 1)
    assert m["total_output_tokens"] == 7 * 4
    assert m["total_input_tokens"] == 7 * 12  # the fake server counts words
    assert m["ttft_ms"]["count"] == 7
    assert m["itl_ms"]["count"] == 7 * 3
    assert m["tpot_ms"]["count"] == 7
    assert m["good_requests"] == 7
    assert 1 <= m["peak_concurrency"] <= 3
    assert fake_server.peak_in_flight <= 3
    assert record["config"]["model"] == "fake-model"  # found via GET /v1/models
    assert record["config"]["request_rate"] == "inf"
    assert record["output_token_sources"] == {"server usage": 7}
    assert list(record["errors"].values()) == [1] and "HTTP 500" in next(iter(record["errors"]))
    assert len(record["requests"]) == 8
    assert sum(not r["success"] for r in record["requests"]) == 1

    assert len(fake_server.requests) == 8
    for body in fake_server.requests:
        assert body["model"] == "fake-model"
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True
        assert body["max_tokens"] == 4
        assert len(body["prompt"].split()) == 12


@pytest.mark.parametrize("fake_server", [{"report_usage": False}], indirect=True)
def test_live_jsonl_chat_counts_failures_and_tokens(
    fake_server: FakeOpenAIServer, tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    lines = [
        {"prompt": "w3 w4 w5", "max_tokens": 3},
        {"prompt": "w6 FAIL_HTTP", "max_tokens": 3},
        {"prompt": "w8 w9", "max_tokens": 5},
        {"prompt": "w10 FAIL_STREAM", "max_tokens": 4},
        {"prompt": "w11"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    metrics = run_bench(
        fake_server.base_url,
        "--endpoint",
        "chat",
        "--model",
        "fake-model",
        "--tokenizer",
        str(tiny_tokenizer_dir),
        "--dataset",
        "jsonl",
        "--dataset-path",
        str(path),
        "--jsonl-output-len",
        "2",
        "--no-ignore-eos",
        "--request-rate",
        "200",
        "--burstiness",
        "0.5",
    )
    assert (metrics.completed, metrics.failed) == (3, 2)
    # No usage from the server: output tokens are counted with the tokenizer ("w7 " = 1 token),
    # prompt tokens come from the dataset.
    assert metrics.total_output_tokens == 3 + 5 + 2
    assert metrics.total_input_tokens == 3 + 2 + 1
    assert metrics.tpot_ms.count == 3
    assert len(fake_server.requests) == 5
    assert all("ignore_eos" not in b for b in fake_server.requests)
    assert all(b["messages"][0]["role"] == "user" for b in fake_server.requests)


@pytest.mark.parametrize("fake_server", [{"chunk_delay": 0.001}], indirect=True)
def test_live_prefix_dataset_and_warmup(
    fake_server: FakeOpenAIServer, tiny_tokenizer_dir: Path
) -> None:
    metrics = run_bench(
        fake_server.base_url,
        "--tokenizer",
        str(tiny_tokenizer_dir),
        "--dataset",
        "prefix",
        "--num-prompts",
        "6",
        "--prefix-num-prefixes",
        "2",
        "--prefix-len",
        "16",
        "--prefix-suffix-len",
        "3",
        "--prefix-output-len",
        "2",
        "--num-warmups",
        "1",
    )
    assert (metrics.completed, metrics.failed) == (6, 0)
    assert len(fake_server.requests) == 7  # one warmup + six timed
    assert len({b["prompt"].split("\n")[0] for b in fake_server.requests}) == 2


def test_live_unreachable_server_counts_failures(tiny_tokenizer_dir: Path) -> None:
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = run_bench(
        f"http://127.0.0.1:{port}",
        "--model",
        "m",
        "--tokenizer",
        str(tiny_tokenizer_dir),
        "--num-prompts",
        "3",
        "--random-input-len",
        "4",
        "--random-output-len",
        "2",
    )
    assert (metrics.completed, metrics.failed) == (0, 3)


def test_main_rejects_bad_options() -> None:
    with pytest.raises(SystemExit):
        serve.main(["--request-rate", "0", "--disable-tqdm"])
    with pytest.raises(SystemExit):
        serve.main(["--goodput", "latency:5", "--disable-tqdm"])
