"""Prometheus metrics (server/common/metrics.py): names, semantics, and agreement with the clients.

Unit tests drive `ServerMetrics` and the scheduler's step stats directly. The server tests
run the CLI (`python -m server serve`, tiny random Llama, 127.0.0.1) and check that what
/metrics reports agrees with what the `openai`/`httpx` clients saw: token totals equal the
sum of the responses' usage, request_success_total equals the finish reasons, prefix-cache
hits equal usage's cached tokens, histogram counts equal the number of requests and tokens,
and the gauges return to 0 once traffic drains. The evaluation of the dashboard and alert
expressions by a real Prometheus is tests/deploy/test_prometheus_live.py.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest

from engine.frontend.async_engine import EngineRequestError
from engine.frontend.core_client import EngineDeadError
from engine.outputs import KVCacheInfo, SchedulerStats
from engine.request_output import CompletionOutput, RequestMetrics, RequestOutput
from server.common import metrics as metrics_module
from server.common.errors import APIError
from server.common.metrics import ServerMetrics
from tests.support import deploy_exprs as dx
from tests.support.metrics import (
    BLOCK_SIZE,
    FORCED_TOKEN,
    MAX_MODEL_LEN,
    MODEL,
    NUM_BLOCKS,
    Samples,
    delta,
    p,
    parse,
    scrape,
    tiny_metrics_server,
    value,
    wait_idle,
    wait_until,
)
from tests.support.scheduler import add, make_scheduler, step
from tests.support.server_fixtures import serving

# --------------------------------------------------------------------------- helpers










def exposed_names_problems(samples: Samples, types: dict[str, str]) -> list[str]:
    """How an exposition's pagedserve:* series differ from tests/support/deploy_exprs.METRICS
    (names, types, labels); the vllm:* copies are checked by test_vllm_names_*."""
    problems = []
    samples = {key: v for key, v in samples.items() if not key[0].startswith("vllm:")}
    names = {name for name, _ in samples}
    allowed = set()
    for metric, kind in dx.METRICS.items():
        if kind == "histogram":
            wanted = [f"{metric}_bucket", f"{metric}_sum", f"{metric}_count"]
        else:
            wanted = [metric]
        allowed.update(wanted)
        if metric not in dx.ON_DEMAND:
            problems += [f"missing series {w}" for w in wanted if w not in names]
    problems += [f"series {n} is not in the catalogue" for n in sorted(names - allowed)]
    for (name, labels), _ in samples.items():
        if "model_name" not in dict(labels):
            problems.append(f"{name} has no model_name label")
    expected_types = {"counter": "counter", "gauge": "gauge", "histogram": "histogram",
                      "info": "gauge"}  # the classic text format has no "info" type
    for metric, kind in dx.METRICS.items():
        family = metric[: -len("_total")] if kind == "counter" else metric
        if types.get(family) != expected_types[kind]:
            problems.append(f"{metric}: type {types.get(family)}, expected {kind}")
    return problems


def finished_output(reasons: list[str | None], *, num_prompt_tokens: int = 4,
                    tokens_per_sequence: int = 3, t0: float = 1000.0) -> RequestOutput:
    outputs = [
        CompletionOutput(index=i, text="", delta_text="", token_ids=[7] * tokens_per_sequence,
                         delta_token_ids=[], finish_reason=reason)
        for i, reason in enumerate(reasons)
    ]
    metrics = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.5,
                             first_token_time=t0 + 1.5, last_token_time=t0 + 2.5,
                             finished_time=t0 + 3.0)
    return RequestOutput(req_id="r", prompt=None, prompt_token_ids=[1] * num_prompt_tokens,
                         outputs=outputs, finished=True, metrics=metrics)


# --------------------------------------------------------------------------- unit tests
def test_exposition_names_types_and_labels_match_the_catalogue():
    metrics = ServerMetrics("m")
    metrics.set_cache_config(
        metrics_module.CacheConfig(block_size=16, num_gpu_blocks_override=8),
        KVCacheInfo(num_blocks=8, block_size=16, max_model_len=64, vocab_size=10))
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain") and "version=0.0.4" in content_type
    samples, types = parse(body.decode())
    assert not exposed_names_problems(samples, types)
    # Every documented label value exists (at 0) before anything happened.
    for reason in ("stop", "length", "abort"):
        assert (p("request_success_total"), (("finished_reason", reason), ("model_name", "m"))) \
            in samples
    for reason in ("validation", "overload", "aborted", "engine_error"):
        assert (p("request_failure_total"), (("model_name", "m"), ("reason", reason))) in samples
    info = {dict(ls)["num_blocks"]: v for (n, ls), v in samples.items()
            if n == p("cache_config_info")}
    assert info == {"8": 1.0}
    labels = next(dict(ls) for (n, ls) in samples if n == p("cache_config_info"))
    assert labels["block_size"] == "16" and labels["enable_prefix_caching"] == "true"
    assert labels["num_tokens"] == "128" and labels["kv_cache_memory_bytes"] == ""


def test_vllm_names_copy_the_families_vllm_has_with_the_same_values():
    metrics = ServerMetrics("m")
    metrics.set_cache_config(
        metrics_module.CacheConfig(block_size=16, num_gpu_blocks_override=8),
        KVCacheInfo(num_blocks=8, block_size=16, max_model_len=64, vocab_size=10))
    metrics.record_request_failure("validation")
    metrics.num_requests_waiting.set(3)
    samples, types = parse(metrics.render()[0].decode())
    vllm = {(n, ls): v for (n, ls), v in samples.items() if n.startswith("vllm:")}
    for (name, labels), v in vllm.items():
        if name in ("vllm:lora_requests_info", "vllm:cache_config_info"):
            continue
        assert samples[("pagedserve:" + name[len("vllm:"):], labels)] == v, name
    assert value(samples, "vllm:num_requests_waiting") == 3
    # The families the routers and vLLM's dashboards read, under vLLM's names.
    for family in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits",
                   "vllm:time_to_first_token_seconds", "vllm:cache_config_info",
                   "vllm:lora_requests_info"):
        assert family in types, family
    info = next(dict(ls) for (n, ls) in vllm if n == "vllm:cache_config_info")
    assert (info["num_gpu_blocks"], info["block_size"]) == ("8", "16")
    lora = next(dict(ls) for (n, ls) in vllm if n == "vllm:lora_requests_info")
    assert lora["max_lora"] == "0" and lora["running_lora_adapters"] == ""
    # Ours only, or vLLM's only.
    metrics.names = "pagedserve"
    assert "vllm:" not in metrics.render()[0].decode()
    metrics.names = "vllm"
    only = parse(metrics.render()[0].decode())[0]
    assert not any(n.startswith("pagedserve:num_requests") for n, _ in only)
    assert ("pagedserve:request_failure_total", (("model_name", "m"), ("reason", "validation"))) \
        in only  # a family vLLM has no counterpart of stays under our name


def test_lora_requests_info_keeps_one_series_of_the_latest_adapters():
    metrics = ServerMetrics("m", max_loras=2)

    def info() -> list[dict]:
        samples = parse(metrics.render()[0].decode())[0]
        return [dict(ls) for (n, ls) in samples if n == "vllm:lora_requests_info"]

    assert info() == [{"model_name": "m", "max_lora": "2", "running_lora_adapters": "",
                       "waiting_lora_adapters": ""}]
    metrics.on_step(SchedulerStats(running_lora_adapters={"b": 1, "a": 2},
                                   waiting_lora_adapters={"c": 1}))
    assert [(i["running_lora_adapters"], i["waiting_lora_adapters"]) for i in info()] == \
        [("a,b", "c")]
    metrics.on_step(SchedulerStats())
    assert [(i["running_lora_adapters"], i["waiting_lora_adapters"]) for i in info()] == \
        [("", "")]
    # Per-adapter counters, once a request under the adapter finished.
    output = finished_output(["stop"], tokens_per_sequence=5)
    output.lora_name = "a"
    metrics.on_request_finished(output, None)
    samples = parse(metrics.render()[0].decode())[0]
    key = (("lora_name", "a"), ("model_name", "m"))
    assert samples[("pagedserve:lora_adapter_requests_total", key)] == 1
    assert samples[("pagedserve:lora_adapter_generation_tokens_total", key)] == 5


def test_catalogue_checker_catches_a_wrong_name():
    samples, types = parse(ServerMetrics("m").render()[0].decode()
                           + "# TYPE pagedserve_stray gauge\npagedserve_stray 1\n")
    problems = exposed_names_problems(samples, types)
    assert any("pagedserve_stray" in problem for problem in problems)
    assert any("cache_config_info" in problem for problem in problems)  # not set yet


def test_two_servers_in_one_process_have_separate_registries():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.record_request_failure("validation")
    samples, _ = parse(b.render()[0].decode())
    assert value(samples, p("request_failure_total")) == 0


def test_on_step():
    metrics = ServerMetrics("m")
    metrics.on_step(SchedulerStats(
        num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25, prefix_cache_queries=40,
        prefix_cache_hits=16, num_preemptions=1, num_scheduled_tokens=43, num_prompt_tokens=24,
        num_generation_tokens=3, num_prompt_tokens_prefilled=40,
        inter_token_latencies_s=[0.02, 0.03], step_duration_s=0.05))
    metrics.on_step(SchedulerStats(num_running_reqs=0, num_waiting_reqs=0))  # idle report
    samples, _ = parse(metrics.render()[0].decode())
    assert value(samples, p("num_requests_running")) == 0
    assert value(samples, p("num_requests_waiting")) == 0
    assert value(samples, p("kv_cache_usage_perc")) == 0
    # Prompt tokens are whole prompts (cache hits included), not the tokens computed.
    assert value(samples, p("prompt_tokens_total")) == 40
    assert value(samples, p("generation_tokens_total")) == 3
    assert value(samples, p("prefix_cache_queries_total")) == 40
    assert value(samples, p("prefix_cache_hits_total")) == 16
    assert value(samples, p("num_preemptions_total")) == 1
    assert value(samples, p("inter_token_latency_seconds_count")) == 2
    assert value(samples, p("inter_token_latency_seconds_sum")) == pytest.approx(0.05)
    # The idle report computed nothing: no step observed for it.
    assert value(samples, p("iteration_tokens_total_count")) == 1
    assert value(samples, p("iteration_tokens_total_sum")) == 43
    assert value(samples, p("step_duration_seconds_count")) == 1
    assert value(samples, p("step_duration_seconds_bucket"), le="0.05") == 1
    assert value(samples, p("step_duration_seconds_bucket"), le="0.03") == 0


def test_spec_decode_counters():
    metrics = ServerMetrics("m")
    for _ in range(2):
        metrics.on_step(SchedulerStats(
            num_scheduled_tokens=10, spec_num_drafts=2, spec_num_draft_tokens=7,
            spec_num_accepted_tokens=4, spec_num_accepted_tokens_per_pos=[2, 1, 1, 0],
            spec_num_grammar_cut_tokens=3))
    # A step whose only draft the grammar cut whole: nothing verified, the cut counted.
    metrics.on_step(SchedulerStats(num_scheduled_tokens=1, spec_num_grammar_cut_tokens=2))
    samples, types = parse(metrics.render()[0].decode())
    assert value(samples, p("spec_decode_num_grammar_cut_tokens_total")) == 8
    assert value(samples, p("spec_decode_num_drafts_total")) == 4
    assert value(samples, p("spec_decode_num_draft_tokens_total")) == 14
    assert value(samples, p("spec_decode_num_accepted_tokens_total")) == 8
    per_pos = {pos: value(samples, p("spec_decode_num_accepted_tokens_per_pos_total"),
                          position=str(pos)) for pos in range(4)}
    assert per_pos == {0: 4, 1: 2, 2: 2, 3: 0}


def test_gauges_follow_the_latest_step():
    metrics = ServerMetrics("m")
    metrics.on_step(SchedulerStats(num_running_reqs=5, num_waiting_reqs=1, kv_cache_usage=0.9))
    samples, _ = parse(metrics.render()[0].decode())
    assert (value(samples, p("num_requests_running")), value(samples, p("num_requests_waiting")),
            value(samples, p("kv_cache_usage_perc"))) == (5, 1, 0.9)


@pytest.mark.parametrize(
    ("reasons", "error", "success", "failure"),
    [
        (["stop"], None, "stop", None),
        (["length"], None, "length", None),
        (["abort"], None, "abort", None),
        ([None], None, "abort", None),  # unfinished sequences: cut short
        (["stop", "length"], None, "length", None),  # n=2: one count, the worse reason
        (["stop", "abort"], None, "abort", None),
        (["error"], "boom", None, "engine_error"),
        (["error", "abort"], "boom", None, "engine_error"),
    ],
)
def test_request_finished_is_counted_once(reasons, error, success, failure):
    metrics = ServerMetrics("m")
    metrics.on_request_finished(finished_output(reasons), error)
    samples, _ = parse(metrics.render()[0].decode())
    assert value(samples, p("request_success_total")) + value(
        samples, p("request_failure_total")) == 1
    if success:
        assert value(samples, p("request_success_total"), finished_reason=success) == 1
    if failure:
        assert value(samples, p("request_failure_total"), reason=failure) == 1


def test_request_latencies():
    metrics = ServerMetrics("m")
    metrics.on_request_finished(finished_output(["length", "length"], tokens_per_sequence=3),
                                None)
    samples, _ = parse(metrics.render()[0].decode())

    def observed(name: str) -> tuple[float, float]:
        return value(samples, p(f"{name}_count")), value(samples, p(f"{name}_sum"))

    assert observed("request_queue_time_seconds") == (1, 0.5)
    assert observed("time_to_first_token_seconds") == (1, 1.5)
    assert observed("request_prefill_time_seconds") == (1, 1.0)
    assert observed("request_decode_time_seconds") == (1, 1.0)
    assert observed("e2e_request_latency_seconds") == (1, 3.0)
    # TPOT: decode time over a sequence's tokens after the first (n sequences in parallel).
    assert observed("request_time_per_output_token_seconds") == (1, 0.5)
    assert observed("request_prompt_tokens") == (1, 4)
    assert observed("request_generation_tokens") == (1, 6)


def test_aborted_and_failed_requests_observe_only_what_happened():
    metrics = ServerMetrics("m")
    metrics.on_request_finished(finished_output(["abort"]), None)
    metrics.on_request_finished(finished_output(["error"]), "boom")
    never_scheduled = finished_output(["abort"])
    never_scheduled.metrics = RequestMetrics(arrival_time=5.0, finished_time=6.0)
    metrics.on_request_finished(never_scheduled, None)
    samples, _ = parse(metrics.render()[0].decode())
    assert value(samples, p("time_to_first_token_seconds_count")) == 2
    assert value(samples, p("request_queue_time_seconds_count")) == 2
    for name in ("e2e_request_latency_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert value(samples, p(f"{name}_count")) == 0, name


def test_failure_reasons():
    reason = metrics_module.failure_reason
    assert reason(APIError(400, "bad")) == "validation"
    assert reason(APIError(401, "key")) == "validation"
    assert reason(APIError(404, "model")) == "validation"
    assert reason(APIError(503, "dead", code="engine_dead")) == "engine_error"
    assert reason(EngineDeadError("dead")) == "engine_error"
    # Counted elsewhere: by the engine (its own failures), by admission control (overload).
    assert reason(APIError(500, "failed", code="engine_error")) is None
    assert reason(EngineRequestError("died under it", engine_dead=True)) is None
    try:
        raise APIError(503, "dead", code="engine_dead") from EngineRequestError("x")
    except APIError as converted:
        assert reason(converted) is None
    assert reason(APIError(504, "timeout", code="request_timeout")) is None
    assert reason(APIError(413, "too large", code="request_too_large")) == "validation"
    assert reason(APIError(503, "full", code="overloaded")) is None
    assert reason(APIError(429, "slow down")) is None
    assert reason(RuntimeError("bug")) is None


def test_record_error_counts_inference_routes_only():
    metrics = ServerMetrics("m")
    metrics.record_error(APIError(400, "bad"), "/v1/completions")
    metrics.record_error(APIError(400, "bad"), "/v1/chat/completions")
    metrics.record_error(APIError(400, "bad"), "/tokenize")
    metrics.record_error(APIError(404, "no route"), "/nope")
    metrics.record_error(EngineDeadError("dead"))  # an in-band stream error (no path)
    metrics.record_request_failure("overload")
    metrics.record_request_failure("aborted")
    samples, _ = parse(metrics.render()[0].decode())
    assert value(samples, p("request_failure_total"), reason="validation") == 2
    assert value(samples, p("request_failure_total"), reason="engine_error") == 1
    assert value(samples, p("request_failure_total"), reason="overload") == 1
    assert value(samples, p("request_failure_total"), reason="aborted") == 1
    with pytest.raises(ValueError, match="unknown failure reason"):
        metrics.record_request_failure("timeout")


def test_buckets_cover_gpu_and_cpu_speeds():
    for buckets in (metrics_module.REQUEST_LATENCY_BUCKETS_S,
                    metrics_module.TOKEN_LATENCY_BUCKETS_S):
        assert list(buckets) == sorted(buckets)
        assert buckets[0] <= 0.001  # a GPU decode step
    assert metrics_module.TOKEN_LATENCY_BUCKETS_S[-1] >= 10  # a slow CPU step
    assert metrics_module.REQUEST_LATENCY_BUCKETS_S[-1] >= 600  # a long CPU generation
    # Several buckets inside each regime, so quantiles are meaningful in both.
    assert sum(0.005 <= b <= 0.1 for b in metrics_module.TOKEN_LATENCY_BUCKETS_S) >= 6
    assert sum(0.1 <= b <= 2.5 for b in metrics_module.TOKEN_LATENCY_BUCKETS_S) >= 5
    assert metrics_module.TOKEN_COUNT_BUCKETS[-1] >= 131072


# ------------------------------------------------------------- scheduler step stats
def test_step_stats_count_each_prompt_once_and_inter_token_latencies():
    """num_prompt_tokens_prefilled: whole prompt at the first token (cache hits included,
    never again after a preemption); one ITL per request per step after its first token."""
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64)  # 24 tokens of KV
    shared = list(range(500, 508))  # 2 blocks of 4
    add(scheduler, "a", shared + [1], max_tokens=1)
    totals = {"prefilled": 0, "generated": 0, "itl": 0, "preemptions": 0}

    def run(max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not scheduler.has_unfinished_requests():
                return
            _, out = step(scheduler)
            stats = out.scheduler_stats
            totals["prefilled"] += stats.num_prompt_tokens_prefilled
            totals["generated"] += stats.num_generation_tokens
            totals["itl"] += len(stats.inter_token_latencies_s)
            totals["preemptions"] += stats.num_preemptions
            assert all(s >= 0 for s in stats.inter_token_latencies_s)
        raise AssertionError("requests did not finish")

    run()
    assert totals == {"prefilled": 9, "generated": 1, "itl": 0, "preemptions": 0}
    # A prefix-cache hit (8 tokens) still counts the whole prompt.
    add(scheduler, "b", shared + [2], max_tokens=3)
    run()
    assert totals == {"prefilled": 18, "generated": 4, "itl": 2, "preemptions": 0}
    # Two requests that need 4 blocks each of the 6: preemption; prompts still once each,
    # and every token after a request's first gives one ITL.
    add(scheduler, "c", 5, max_tokens=12)
    add(scheduler, "d", 5, max_tokens=12)
    run()
    assert totals["preemptions"] > 0
    assert totals == {"prefilled": 18 + 5 + 5, "generated": 4 + 12 + 12,
                      "itl": 2 + 11 + 11, "preemptions": totals["preemptions"]}


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tiny_metrics_server(tmp_path_factory)) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c








def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_live_exposition_matches_the_catalogue(server, client):
    client.completions.create(model=MODEL, prompt=tokens(100, 5), max_tokens=2)
    for accept in ("", "application/openmetrics-text; version=1.0.0"):
        response = httpx.get(server.url + "/metrics", headers={"Accept": accept} if accept
                             else {}, timeout=10)
        assert response.headers["content-type"].startswith("text/plain")
        samples, types = parse(response.text)
        assert not exposed_names_problems(samples, types), accept
        assert "pagedserve_" not in response.text  # colons kept even when OpenMetrics is asked
    info = [dict(ls) for (n, ls) in samples if n == p("cache_config_info")]
    assert info and info[0]["num_blocks"] == str(NUM_BLOCKS)
    assert info[0]["block_size"] == str(BLOCK_SIZE) and info[0]["model_name"] == MODEL


def test_counters_agree_with_what_the_clients_saw(server, client):
    before = wait_idle(server.url)
    usages = []  # (prompt_tokens, completion_tokens, cached_tokens, per-choice token counts)
    reasons = []
    ignore_eos = {"ignore_eos": True}

    def completion(**kwargs):
        result = client.completions.create(model=MODEL, **kwargs)
        u = result.usage
        usages.append((u.prompt_tokens, u.completion_tokens,
                       u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0))
        reasons.extend(c.finish_reason for c in result.choices)
        return result

    # Non-streamed, length-limited.
    completion(prompt=tokens(100, 7), max_tokens=9, extra_body=ignore_eos)
    # A batch of two prompts (two requests), different lengths.
    completion(prompt=[tokens(120, 5), tokens(130, 11)], max_tokens=4, extra_body=ignore_eos)
    # Ends "stop" on a stop token (the core stops; no stop-string overshoot).
    completion(prompt=tokens(150, 6), max_tokens=20, temperature=0,
               logit_bias={str(FORCED_TOKEN): 100},
               extra_body={"stop_token_ids": [FORCED_TOKEN], "min_tokens": 3})
    # A prefix-cache hit: the same 3-block prompt twice (then 2 blocks are served cached).
    shared = tokens(200, 3 * BLOCK_SIZE + 2)
    completion(prompt=shared, max_tokens=3, extra_body=ignore_eos)
    second = completion(prompt=shared, max_tokens=3, extra_body=ignore_eos)
    assert second.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK_SIZE
    # Streamed completion with usage.
    stream = client.completions.create(model=MODEL, prompt=tokens(260, 9), max_tokens=6,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body=ignore_eos)
    chunks = list(stream)
    u = chunks[-1].usage
    usages.append((u.prompt_tokens, u.completion_tokens, 0))
    reasons += [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    # Chat, non-streamed and streamed.
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                          extra_body=ignore_eos)
    usages.append((chat.usage.prompt_tokens, chat.usage.completion_tokens, 0))
    reasons.append(chat.choices[0].finish_reason)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8,
        stream=True, stream_options={"include_usage": True}, temperature=0,
        logit_bias={str(FORCED_TOKEN): 100},
        extra_body={"stop_token_ids": [FORCED_TOKEN], "min_tokens": 2})
    chunks = list(stream)
    u = chunks[-1].usage
    usages.append((u.prompt_tokens, u.completion_tokens, 0))
    reasons += [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert reasons.count("stop") == 2 and reasons.count("length") == 7

    after = wait_idle(server.url)
    num_requests = len(reasons)  # n=1 everywhere: one choice per request
    prompt_tokens = sum(u[0] for u in usages)
    completion_tokens = sum(u[1] for u in usages)
    cached_tokens = sum(u[2] for u in usages)
    assert delta(after, before, p("prompt_tokens_total")) == prompt_tokens
    assert delta(after, before, p("generation_tokens_total")) == completion_tokens
    assert delta(after, before, p("request_success_total"), finished_reason="stop") == 2
    assert delta(after, before, p("request_success_total"), finished_reason="length") == 7
    assert delta(after, before, p("request_success_total"), finished_reason="abort") == 0
    assert delta(after, before, p("request_failure_total")) == 0
    # One lookup per request (the cache never ran short): queries are the prompts.
    assert delta(after, before, p("prefix_cache_queries_total")) == prompt_tokens
    assert delta(after, before, p("prefix_cache_hits_total")) == cached_tokens > 0
    assert delta(after, before, p("num_preemptions_total")) == 0
    # Per-request histograms: one observation per request, sums are the usage.
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_time_per_output_token_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta(after, before, p(f"{name}_count")) == num_requests, name
    assert delta(after, before, p("request_prompt_tokens_sum")) == prompt_tokens
    assert delta(after, before, p("request_generation_tokens_sum")) == completion_tokens
    # One ITL per token after a request's first; every step computes the uncached prompt
    # tokens once and each sampled token but the last.
    assert delta(after, before, p("inter_token_latency_seconds_count")) == \
        completion_tokens - num_requests
    assert delta(after, before, p("iteration_tokens_total_sum")) == \
        (prompt_tokens - cached_tokens) + (completion_tokens - num_requests)
    assert delta(after, before, p("step_duration_seconds_count")) == \
        delta(after, before, p("iteration_tokens_total_count")) > 0
    # Latency sums are plausible: TTFT <= e2e, the parts of e2e add up.
    ttft = delta(after, before, p("time_to_first_token_seconds_sum"))
    e2e = delta(after, before, p("e2e_request_latency_seconds_sum"))
    parts = sum(delta(after, before, p(f"request_{name}_time_seconds_sum"))
                for name in ("queue", "prefill", "decode"))
    assert 0 < ttft <= e2e and parts <= e2e + 1e-6


def test_failures_and_aborts(server, client):
    before = wait_idle(server.url)
    # Validation: a bad field, an unknown model, a missing field (pydantic), a too long prompt.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL},
                          timeout=10)
    assert response.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=tokens(100, MAX_MODEL_LEN + 5),
                                  max_tokens=1)
    # Not inference requests: not counted.
    assert httpx.post(server.url + "/tokenize", json={"model": MODEL},
                      timeout=10).status_code == 400
    assert httpx.get(server.url + "/no-such-route", timeout=10).status_code == 404

    # A client that leaves mid-stream: the engine aborts it, counted as finished "abort".
    async def abort_one() -> int:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=60) as aclient:
            stream = await aclient.completions.create(
                model=MODEL, prompt=tokens(300, 5), max_tokens=MAX_MODEL_LEN - 10,
                stream=True, extra_body={"ignore_eos": True})
            received = 0
            async for chunk in stream:
                received += sum(1 for c in chunk.choices if c.text is not None)
                if received >= 2:
                    break
            await stream.close()
            return received

    assert asyncio.run(abort_one()) >= 2
    after = wait_until(
        lambda: (s := scrape(server.url)) and delta(
            s, before, p("request_success_total"), finished_reason="abort") >= 1 and s,
        what="the aborted request to be counted")
    after = wait_idle(server.url)
    assert delta(after, before, p("request_failure_total"), reason="validation") == 4
    assert delta(after, before, p("request_failure_total"), reason="engine_error") == 0
    assert delta(after, before, p("request_failure_total"), reason="aborted") == 0
    assert delta(after, before, p("request_success_total"), finished_reason="abort") == 1
    assert delta(after, before, p("request_success_total"), finished_reason="stop") == 0
    assert delta(after, before, p("request_success_total"), finished_reason="length") == 0
    # The abort observed its TTFT and queue time, but no completion histograms.
    assert delta(after, before, p("time_to_first_token_seconds_count")) == 1
    assert delta(after, before, p("e2e_request_latency_seconds_count")) == 0


def test_preemption_counts_each_prompt_once(server):
    """A burst that outgrows the KV cache: preemptions, waiting requests, and the token
    totals still equal the usage (a recomputed prompt is not counted again)."""
    before = wait_idle(server.url)
    num_requests, max_tokens = 6, 150  # 6 x ~10 blocks >> 32 blocks
    peak = {"waiting": 0.0, "kv": 0.0}

    async def burst() -> list:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=120) as aclient:
            async def watch() -> None:
                async with httpx.AsyncClient(timeout=10) as http:
                    while True:
                        samples = parse((await http.get(server.url + "/metrics")).text)[0]
                        peak["waiting"] = max(peak["waiting"],
                                              value(samples, p("num_requests_waiting")))
                        peak["kv"] = max(peak["kv"], value(samples, p("kv_cache_usage_perc")))
                        await asyncio.sleep(0.1)

            watcher = asyncio.ensure_future(watch())
            try:
                return await asyncio.gather(*(
                    aclient.completions.create(model=MODEL, prompt=tokens(400 + 10 * i, 8),
                                               max_tokens=max_tokens,
                                               extra_body={"ignore_eos": True})
                    for i in range(num_requests)))
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)

    def peaks_seen() -> bool:
        return peak["waiting"] >= 1 and peak["kv"] > 0.5

    # The gauges are sampled every 0.1 s while a burst runs; on a busy machine no sample
    # need land in the moments of a burst with requests waiting, so bursts are repeated
    # (at most 5, normally 1) until the samples have seen it.
    results = []
    for _ in range(5):
        results += asyncio.run(burst())
        if peaks_seen():
            break
    after = wait_idle(server.url)
    assert all(r.choices[0].finish_reason == "length" for r in results)
    assert delta(after, before, p("num_preemptions_total")) > 0
    assert delta(after, before, p("prompt_tokens_total")) == sum(
        r.usage.prompt_tokens for r in results)
    assert delta(after, before, p("generation_tokens_total")) == sum(
        r.usage.completion_tokens for r in results) == len(results) * max_tokens
    assert delta(after, before, p("request_success_total"), finished_reason="length") == \
        len(results)
    assert peaks_seen() and peak["kv"] <= 1.0, peak
    # Preempted or not, one ITL per token after the first.
    assert delta(after, before, p("inter_token_latency_seconds_count")) == \
        len(results) * (max_tokens - 1)


def test_gauges_return_to_zero_after_traffic(server):
    samples = wait_idle(server.url)  # free prefix-cached blocks count as free
    assert value(samples, p("prefix_cache_hits_total")) > 0  # cached blocks do exist
    assert math.isclose(value(samples, p("kv_cache_usage_perc")), 0.0)

