"""A real Prometheus scrapes a real pagedserve; every dashboard and alert expression is
evaluated through Prometheus' HTTP API.

Set-up (all on 127.0.0.1): pagedserve (the CLI, tiny random Llama, a 32-block KV cache so
a burst preempts), then Debian's `prometheus` binary run by this test in a temporary
directory (never the system service) with docker/prometheus.yml as shipped except: scrape
and rule-evaluation interval 1 s, the `pagedserve` job's target is this server, the
`prometheus` job's target is this Prometheus, and deploy/prometheus/alerts.yaml beside it
(the same relative `rule_files` entry the compose stack uses). Prometheus is installed
with apt-get when absent (tests/support/deploy_exprs.promtool()); the test skips only when it
cannot be.

Traffic: non-streamed and streamed completions and chat, a stop-token finish, a
prefix-cache hit, a client that leaves mid-stream (abort), bad requests (validation), and
a concurrent burst larger than the KV cache (preemptions, waiting requests, KV usage).

Then every expression of deploy/grafana/pagedserve.json (panel order, Grafana variables
substituted by tests/support/deploy_exprs.dashboard_expressions) must be accepted by
/api/v1/query and return at least one finite sample, for the dashboard's "All" model
(`.+`) and for the concrete model. `$__rate_interval` becomes the time since the traffic
started plus 5 s (about 15-25 s here): Grafana would use max(4 x scrape interval,
step + scrape interval), a few seconds at a 1 s scrape, which would only cover the end of
the traffic; the longer window covers all of it, so rates, ratios and quantiles have data.
All these queries are evaluated at one fixed time, just after the traffic (the `time`
parameter), so the window does not slide past the traffic while a slow machine works
through them.
No panel is exempt. Every alert rule expression must be accepted too, and
Prometheus' own evaluation of the loaded rules must report every rule healthy.

`promtool check config` / `check rules` of the shipped files are tests/deploy/test_deploy.py's;
here only the generated live configuration is checked with `promtool check config`.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
import time

import httpx
import openai
import pytest
import yaml

from tests.support import deploy_exprs as dx
from tests.support.metrics import (
    BLOCK_SIZE,
    FORCED_TOKEN,
    MAX_MODEL_LEN,
    MODEL,
    parse,
    tiny_metrics_server,
    value,
    wait_until,
)
from tests.support.server_fixtures import free_port, serving, stop_process

pytestmark = pytest.mark.slow

PROMETHEUS_CONFIG = dx.REPO_ROOT / "docker" / "prometheus.yml"


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def binaries() -> tuple[str, str]:
    promtool = dx.promtool()
    prometheus = shutil.which("prometheus")
    if promtool is None or prometheus is None:
        pytest.skip("Prometheus is missing and cannot be installed here (Debian package "
                    "'prometheus' via apt-get, needs root)")
    return prometheus, promtool


@pytest.fixture(scope="module")
def server(binaries, tmp_path_factory):
    # n-gram speculation on, so the speculative-decoding panels have data (a repeating
    # prompt below makes the proposer draft).
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}'
    with serving(tiny_metrics_server(tmp_path_factory, "--speculative-config", spec)) as proc:
        yield proc


def live_config(server_url: str, prometheus_port: int) -> dict:
    """docker/prometheus.yml with 1 s intervals and this test's targets."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    target = server_url.removeprefix("http://")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"pagedserve", "prometheus"}, "update this test with the config"
    jobs["pagedserve"]["static_configs"] = [{"targets": [target]}]
    jobs["prometheus"]["static_configs"] = [{"targets": [f"127.0.0.1:{prometheus_port}"]}]
    assert config["rule_files"] == ["alerts.yaml"]
    return config


@pytest.fixture(scope="module")
def prometheus(binaries, server, tmp_path_factory):
    prometheus_bin, promtool = binaries
    directory = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config_path = directory / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(live_config(server.url, port), sort_keys=False))
    shutil.copy(dx.ALERTS_PATH, directory / "alerts.yaml")
    check = subprocess.run([promtool, "check", "config", str(config_path)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    log = (directory / "prometheus.log").open("w")
    process = subprocess.Popen(
        [prometheus_bin, f"--config.file={config_path}",
         f"--storage.tsdb.path={directory / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        cwd=directory, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # generous: ready in about a second when idle
        while True:
            if process.poll() is not None:
                pytest.fail("prometheus exited:\n" + (directory / "prometheus.log").read_text())
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("prometheus did not become ready:\n"
                            + (directory / "prometheus.log").read_text())
            time.sleep(0.1)
        yield url
    finally:
        stop_process(process, 15)
        log.close()


# --------------------------------------------------------------------------- helpers
def query(prometheus_url: str, expr: str, at: float | None = None) -> dict:
    """The `data` of an instant query (evaluated now, or at time `at`); fails with
    Prometheus' error if it is rejected."""
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    response = httpx.get(prometheus_url + "/api/v1/query", params=params, timeout=60)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]


def finite_values(data: dict) -> list[float]:
    assert data["resultType"] == "vector", data
    values = [float(sample["value"][1]) for sample in data["result"]]
    return [v for v in values if math.isfinite(v)]


def scalar(prometheus_url: str, expr: str, at: float | None = None) -> float:
    values = finite_values(query(prometheus_url, expr, at))
    assert len(values) == 1, (expr, values)
    return values[0]


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


async def drive_traffic(url: str, prometheus_url: str, started: float,
                        timeout_s: float = 300) -> dict[str, int]:
    """Mixed traffic; returns what the clients saw (requests by outcome)."""
    deadline = time.monotonic() + timeout_s
    seen = {"stop": 0, "length": 0, "abort": 0, "validation": 0}
    ignore_eos = {"ignore_eos": True}
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        # A prefix-cache hit: the same 3-block prompt twice.
        shared = tokens(200, 3 * BLOCK_SIZE + 2)
        for _ in range(2):
            result = await client.completions.create(model=MODEL, prompt=shared, max_tokens=4,
                                                     extra_body=ignore_eos)
            seen["length"] += 1
        assert result.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK_SIZE
        # Streamed completion; non-streamed and streamed chat; a stop-token finish.
        stream = await client.completions.create(
            model=MODEL, prompt=tokens(260, 9), max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body=ignore_eos)
        async for _ in stream:
            pass
        seen["length"] += 1
        messages = [{"role": "user", "content": "Hello there, how are you?"}]
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                             extra_body=ignore_eos)
        seen["length"] += 1
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, stream=True, temperature=0,
            logit_bias={str(FORCED_TOKEN): 100},
            extra_body={"stop_token_ids": [FORCED_TOKEN], "min_tokens": 4})
        async for _ in stream:
            pass
        seen["stop"] += 1
        # A prompt that repeats itself, and an output that goes on repeating it (the bias):
        # the n-gram proposer drafts, the model accepts (the spec-decode panels).
        await client.completions.create(model=MODEL, prompt=[340] * 12, max_tokens=8,
                                        temperature=0, logit_bias={"340": 100},
                                        extra_body=ignore_eos)
        seen["length"] += 1
        # A constrained request (its grammar is compiled: the compile-time panels).
        constrained = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0,
            response_format={"type": "json_object"})
        seen[constrained.choices[0].finish_reason] += 1
        # A client that leaves mid-stream.
        stream = await client.completions.create(
            model=MODEL, prompt=tokens(300, 5), max_tokens=MAX_MODEL_LEN - 10, stream=True,
            extra_body=ignore_eos)
        received = 0
        async for chunk in stream:
            received += len(chunk.choices)
            if received >= 2:
                break
        await stream.close()
        seen["abort"] += 1
        # Bad requests.
        for kwargs in ({"model": MODEL, "prompt": "hi", "max_tokens": -1},
                       {"model": MODEL, "prompt": tokens(100, MAX_MODEL_LEN + 5),
                        "max_tokens": 1}):
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(**kwargs)
            seen["validation"] += 1
        # A burst bigger than the KV cache (6 x 10 blocks of 32): preemption, waiting.
        # Repeated until Prometheus has stored a busy sample of the gauges: a 1 s scrape
        # need not land inside one burst on a busy machine, so the test waits for the
        # observation instead of hoping for it.
        bursts = 0
        while True:
            burst = asyncio.gather(*(
                client.completions.create(model=MODEL, prompt=tokens(400 + 10 * i, 8),
                                          max_tokens=150, extra_body=ignore_eos)
                for i in range(6)))
            observed = await busy_observed(prometheus_url, burst, started)
            results = await burst
            seen["length"] += len(results)
            bursts += 1
            if observed:
                break
            assert time.monotonic() < deadline, (
                f"Prometheus stored no busy gauge sample during {bursts} bursts")
    seen["bursts"] = bursts
    return seen


def window_max(prometheus_url: str, metric: str, since: float) -> float:
    """The largest sample Prometheus stored for `metric` since `since` (0 if none)."""
    window = f"{math.ceil(time.time() - since) + 5}s"
    values = finite_values(query(prometheus_url, f"max(max_over_time({metric}[{window}]))"))
    return values[0] if values else 0.0


def busy_seen(prometheus_url: str, since: float) -> bool:
    """Prometheus has stored a sample with KV usage > 0 and one with a running request."""
    return (window_max(prometheus_url, "pagedserve:kv_cache_usage_perc", since) > 0
            and window_max(prometheus_url, "pagedserve:num_requests_running", since) >= 1)


async def busy_observed(prometheus_url: str, burst: asyncio.Future, since: float) -> bool:
    """Poll Prometheus while `burst` runs (and once after it): True once it has stored
    the busy gauges."""
    while True:
        done = burst.done()
        if await asyncio.to_thread(busy_seen, prometheus_url, since):
            return True
        if done:
            return False
        await asyncio.wait([burst], timeout=0.2)


# --------------------------------------------------------------------------- the test
def test_dashboard_and_alerts_against_a_live_prometheus(server, prometheus):
    started = time.time()

    # The target is scraped before any traffic (counters start at 0).
    wait_until(lambda: finite_values(query(prometheus, 'up{job="pagedserve"}')) == [1.0],
               120, "the first scrape of pagedserve", poll_s=0.2)
    seen = asyncio.run(drive_traffic(server.url, prometheus, started))
    print(f"\nbursts until Prometheus stored the busy gauges: {seen.pop('bursts')}")

    # Drained, and Prometheus has scraped the final values (then one scrape more).
    def final_metrics():
        samples = parse(httpx.get(server.url + "/metrics", timeout=60).text)[0]
        busy = sum(value(samples, "pagedserve:" + name) for name in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
        done = value(samples, "pagedserve:request_success_total")
        return samples if busy == 0 and done == sum(
            seen[r] for r in ("stop", "length", "abort")) else None

    # Deadlines here are generous (polls return as soon as the condition holds): the
    # server drains in about a second and Prometheus scrapes every second when idle.
    samples = wait_until(final_metrics, 120, "the server to drain", poll_s=0.2)
    total = value(samples, "pagedserve:generation_tokens_total")
    wait_until(lambda: scalar(prometheus, "sum(pagedserve:generation_tokens_total)") == total
               and scalar(prometheus, "sum(pagedserve:num_requests_running)") == 0,
               120, "Prometheus to scrape the final values", poll_s=0.2)
    final_scrape = scalar(prometheus, 'timestamp(up{job="pagedserve"})')
    wait_until(lambda: scalar(prometheus, 'timestamp(up{job="pagedserve"})') > final_scrape,
               120, "one scrape more", poll_s=0.2)

    # What Prometheus stored is what the server exposed, under the catalogue's names.
    for name in ("prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total"):
        assert scalar(prometheus, f'sum(pagedserve:{name}{{model_name="{MODEL}"}})') == \
            value(samples, "pagedserve:" + name), name
    names = {s["metric"]["__name__"] for s in query(
        prometheus, 'count by (__name__) ({__name__=~"pagedserve:.+", job="pagedserve"})'
    )["result"]}
    expected = set()
    for metric, kind in dx.METRICS.items():
        expected |= ({f"{metric}_{s}" for s in ("bucket", "sum", "count")}
                     if kind == "histogram" else {metric})
    assert names == expected - dx.ON_DEMAND  # no adapters here
    for reason in ("stop", "length", "abort"):
        assert scalar(prometheus, 'sum(pagedserve:request_success_total'
                                  f'{{finished_reason="{reason}"}})') == seen[reason], reason
    assert scalar(prometheus, 'sum(pagedserve:request_failure_total{reason="validation"})') \
        == seen["validation"]
    assert scalar(prometheus, "sum(pagedserve:num_preemptions_total)") > 0
    assert scalar(prometheus, "sum(pagedserve:prefix_cache_hits_total)") >= 3 * BLOCK_SIZE

    # Window queries are evaluated at `at` (after the final scrapes): a window that
    # covers all the traffic then, whenever the query runs.
    at = time.time()
    window = f"{math.ceil(at - started) + 5}s"
    # The gauges moved during the burst (drive_traffic repeated it until a scrape caught
    # it; here the stored values are checked over the whole window).
    assert scalar(prometheus, f"max(max_over_time(pagedserve:kv_cache_usage_perc[{window}]))",
                  at) > 0
    assert scalar(prometheus,
                  f"max(max_over_time(pagedserve:num_requests_running[{window}]))", at) >= 1

    # Every dashboard expression: accepted, and at least one finite sample.
    no_data = []
    for model_name in (".+", MODEL):  # the dashboard's "All", and one model
        variables = {"model_name": model_name, "__rate_interval": window}
        for expr in dx.dashboard_expressions(dx.DASHBOARD_PATH, variables):
            if "pagedserve:embedding_" in expr:
                continue  # this chat model serves no embeddings: their quantiles are NaN
            if "pagedserve:lora_adapter_" in expr:
                continue  # no adapters here: those series do not exist
            if not finite_values(query(prometheus, expr, at)):
                no_data.append(expr)
    assert not no_data, "dashboard expressions without data:\n" + "\n".join(no_data)

    # Every alert expression: accepted (whether it fires depends on the traffic), and
    # Prometheus' own evaluation of the loaded rules is healthy.
    for expr in dx.alert_expressions(dx.ALERTS_PATH):
        query(prometheus, expr, at)
    alerts = {rule["alert"]: str(rule["expr"]) for rule in dx.alert_rules(dx.ALERTS_PATH)}
    for name in ("PagedserveDown", "PagedserveNotScraped"):  # the target is up
        assert not query(prometheus, alerts[name])["result"], name

    def rules_evaluated():
        groups = httpx.get(prometheus + "/api/v1/rules", timeout=60).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20")
                                      and not r["lastEvaluation"].startswith("0001")
                                      for r in rules) else None

    rules = wait_until(rules_evaluated, 120, "Prometheus to evaluate the rules", poll_s=0.2)
    assert {r["name"] for r in rules} == {r["alert"] for r in dx.alert_rules()}
    unhealthy = [(r["name"], r["health"], r.get("lastError")) for r in rules
                 if r["health"] != "ok"]
    assert not unhealthy
    targets = httpx.get(prometheus + "/api/v1/targets", timeout=60).json()["data"]
    health = {t["labels"]["job"]: t["health"] for t in targets["activeTargets"]}
    assert health == {"pagedserve": "up", "prometheus": "up"}


def test_live_config_keeps_the_shipped_jobs():
    """The live configuration is the shipped one with only targets and intervals changed."""
    shipped = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    live = live_config("http://127.0.0.1:1234", 9999)
    assert live["rule_files"] == shipped["rule_files"]
    assert [j["job_name"] for j in live["scrape_configs"]] == \
        [j["job_name"] for j in shipped["scrape_configs"]]
    job = next(j for j in live["scrape_configs"] if j["job_name"] == "pagedserve")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"] == [{"targets": ["127.0.0.1:1234"]}]
