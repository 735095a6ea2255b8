"""`serve --api-server-count 2`: two API server processes on one port over one engine core.

Unit tests drive the core's router (engine/core/shared_core.py, SharedEngineCoreProc) over a stub
core: outputs split by request owner (every frontend hears of every step), stats to
frontend 0 only, replies to the asker,
duplicate ids refused, aborts limited to the sender's requests, Shutdown only from the
launcher. Flag validation runs in-process.

The server tests run the CLI (`python -m server serve`, the tiny random Llama, 127.0.0.1)
with `--api-server-count 2`, and, for reference, one API server with the same flags in
this process (its engine core in a thread, which saves a process start). Every response of the pair says which API server answered
(`x-pagedserve-api-server`), so the tests can require both to have served some, and
that greedy outputs (httpx and the `openai` client, streamed and not) equal the
reference's; a client leaving a stream on one API server ends only that request (the
other's streams run to `length`) and frees every KV block; /metrics from either API
server counts the requests of both; a killed engine core is reported (503) by both;
SIGTERM to the launcher then still ends every child process and removes the metrics
directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from typing import NamedTuple

import httpx
import openai
import pytest

from engine.core.shared_core import STATS_FRONTEND, FromFrontend, SharedEngineCoreProc
from engine.ipc import (
    AbortRequests,
    AddRequest,
    Outputs,
    Ping,
    Pong,
    Shutdown,
    frontend_identity,
    frontend_index,
)
from engine.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from engine.request import EngineCoreRequest
from engine.sampling_params import SamplingParams
from tests.support.metrics import parse, value, wait_until
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.server_fixtures import ServerProcess, ServerThread

HEADER = "x-pagedserve-api-server"
PROMPTS = ["Hello world", "The quick brown fox", "Paged attention", "1 2 3 4",
           "Stop strings may span", "KV cache blocks", "A tiny model", "pagedserve"]


# ---------------------------------------------------------------- the router (unit)
class _StubCore:
    """What SharedEngineCoreProc needs of an EngineCore: requests in, scripted steps out."""

    executor = None

    def __init__(self):
        self.req_ids: list[str] = []
        self.aborted: list[str] = []
        self.next_step = EngineCoreOutputs()
        self.num_steps = self.num_steps_applied = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        self.req_ids.append(request.req_id)

    def abort_requests(self, req_ids: list[str]) -> None:
        self.aborted.extend(req_ids)

    def has_unfinished_requests(self) -> bool:
        return False

    def step(self) -> EngineCoreOutputs:
        self.num_steps += 1
        self.num_steps_applied += 1
        return self.next_step


def _add(req_id: str) -> AddRequest:
    return AddRequest(EngineCoreRequest(req_id=req_id, prompt_token_ids=[1, 2],
                                        sampling_params=SamplingParams(max_tokens=4)))


class Sent(NamedTuple):
    """What the router handed to `send_to`: the frontend (None: every one), the message."""

    client_index: int | None
    message: object


def test_router_splits_outputs_by_owner_and_answers_the_asker():
    sent: list[Sent] = []
    core = _StubCore()
    proc = SharedEngineCoreProc(core, lambda message, to: sent.append(Sent(to, message)), 2)
    proc._handle(FromFrontend(0, _add("a")))
    proc._handle(FromFrontend(1, _add("b")))
    proc._handle(FromFrontend(1, _add("a")))  # in use by frontend 0: refused, to 1 only
    assert core.req_ids == ["a", "b"]
    assert [(m.client_index, type(m.message)) for m in sent] == [(1, Outputs)]
    refused = sent.pop().message.outputs.outputs[0]
    assert (refused.req_id, refused.finish_reason) == ("a", "error")

    stats = SchedulerStats(num_running_reqs=2)
    core.next_step = EngineCoreOutputs(
        outputs=[EngineCoreOutput("a", [5]), EngineCoreOutput("b", [6], "length")],
        scheduler_stats=stats, timestamp=1.0, scheduled_times={"a": 0.5, "b": 0.6})
    proc._step()
    by_frontend = {m.client_index: m.message.outputs for m in sent}
    assert set(by_frontend) == {0, 1}
    assert [o.req_id for o in by_frontend[0].outputs] == ["a"]
    assert [o.req_id for o in by_frontend[1].outputs] == ["b"]
    assert by_frontend[0].scheduled_times == {"a": 0.5}
    assert by_frontend[1].scheduled_times == {"b": 0.6}
    assert by_frontend[STATS_FRONTEND].scheduler_stats is stats
    assert by_frontend[1].scheduler_stats is None
    assert proc.owners == {"a": 0}  # "b" finished

    # Stats with no output for frontend 0 still reach it; frontend 1 gets an empty part
    # (every frontend hears of every step: a busy core is not a stuck one).
    sent.clear()
    core.next_step = EngineCoreOutputs(scheduler_stats=stats, timestamp=2.0)
    proc._step()
    assert [(m.client_index, m.message.outputs) for m in sent] == [
        (0, EngineCoreOutputs(scheduler_stats=stats, timestamp=2.0)),
        (1, EngineCoreOutputs(timestamp=2.0))]

    # Aborts touch the sender's requests only; a Pong goes to the asker.
    sent.clear()
    proc._handle(FromFrontend(1, AbortRequests(["a"])))
    assert core.aborted == [] and proc.owners == {"a": 0}
    proc._handle(FromFrontend(0, AbortRequests(["a"])))
    assert core.aborted == ["a"] and proc.owners == {}
    proc._handle(FromFrontend(1, Ping(7)))
    assert [(m.client_index, m.message) for m in sent] == [(1, Pong(7))]

    # Only the launcher (no frontend index) stops the loop.
    proc._handle(FromFrontend(0, Shutdown()))
    assert proc._running
    proc._handle(FromFrontend(None, Shutdown()))
    assert not proc._running


def test_frontend_identities_round_trip():
    assert [frontend_index(frontend_identity(k)) for k in (0, 1, 12)] == [0, 1, 12]
    assert frontend_index(b"launcher") is None


def test_flag_validation(tmp_path):
    from server.http.api_server import ServeOptions
    from server.http.cli import main
    from server.http.launcher import run_launcher

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--api-server-count", "0"])
    assert exit_info.value.code == 2
    with pytest.raises(ValueError, match="own process"):
        run_launcher(ServeOptions(engine_mode="thread"), None, tmp_path, ["m"], 2)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the server
def _children(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _reference_server(flags: list[str]) -> ServerThread:
    """One API server with the same flags, in this process, its engine core in a thread
    (the engine of `serve` without a process start: this machine has 2 busy cores)."""
    from server.http.api_server import APIServer, ServeOptions
    from server.http.cli import _build_cli_parser, engine_config_from_args

    args = _build_cli_parser().parse_args(["serve", *flags])
    config = engine_config_from_args(args, args.model, "tiny")
    options = ServeOptions(port=0, engine_mode="thread", log_level="warning")
    return ServerThread(APIServer(options, config, args.model, ["tiny"])).start()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(the 2-API-server launcher, a single API server for reference), started together."""
    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    flags = ["--model", str(checkpoint), "--port", "0", "--served-model-name", "tiny",
             "--block-size", "16", "--num-gpu-blocks-override", "128",
             "--max-model-len", "256", "--max-num-seqs", "16"]
    pair = ServerProcess([*flags, "--api-server-count", "2"], {"PAGEDSERVE_LOG_LEVEL": "info"})
    single = None
    try:
        single = _reference_server(flags)
        pair.url = pair.wait_for_url()
        yield pair, single
    finally:
        if single is not None:
            single.stop()
        pair.stop()  # a no-op after the SIGTERM test


def _complete(url: str, prompt: str, client: httpx.Client) -> tuple[str, str]:
    response = client.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"], response.headers.get(HEADER, "")


async def _completions(url: str, prompts: list[str], stream: bool) -> list[tuple[str, str]]:
    """Concurrent greedy completions, one connection each: (text, API server)."""

    async def one(prompt: str) -> tuple[str, str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                    "stream": stream}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                server = response.headers[HEADER]
                if not stream:
                    return json.loads(await response.aread())["choices"][0]["text"], server
                text = ""
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choices = json.loads(line[6:])["choices"]
                        text += choices[0]["text"] if choices else ""
                return text, server

    return await asyncio.gather(*(one(prompt) for prompt in prompts))


def _api_server_pids(pair: ServerProcess) -> dict[str, int]:
    """API server index -> pid, from the launcher's "N API servers (pids a, b)" line."""
    for line in pair.lines:
        match = re.search(r"API servers \(pids ([\d, ]+)\)", line)
        if match:
            return {str(k): int(pid) for k, pid in enumerate(match.group(1).split(", "))}
    raise AssertionError("the launcher did not log its API servers' pids")


@contextlib.contextmanager
def only_api_server(pair: ServerProcess, index: str):
    """New connections made inside go to API server `index`: the others are paused
    (SIGSTOP) meanwhile, so only it accepts from the shared listening socket. Left to
    itself the kernel picks, and may pick the same API server every time (seen in CI)."""
    others = [pid for k, pid in _api_server_pids(pair).items() if k != index]
    for pid in others:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in others:
            os.kill(pid, signal.SIGCONT)


def test_both_api_servers_serve_the_same_greedy_outputs(servers):
    pair, single = servers
    with httpx.Client(timeout=60) as client:
        reference = {prompt: _complete(single.url, prompt, client)[0] for prompt in PROMPTS}
        assert all(text for text in reference.values())
        for index in ("0", "1"):
            with only_api_server(pair, index):
                for stream in (False, True):
                    results = asyncio.run(_completions(pair.url, PROMPTS, stream))
                    assert [text for text, _ in results] == [reference[p] for p in PROMPTS]
                    assert {server for _, server in results} == {index}
        for path in ("/health", "/v1/models", "/version"):
            response = client.get(pair.url + path)
            assert response.status_code == 200 and response.headers[HEADER] in {"0", "1"}

    with openai.OpenAI(base_url=pair.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as oai:
        prompt = PROMPTS[0]
        completion = oai.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                            temperature=0)
        assert completion.choices[0].text == reference[prompt]
        streamed = "".join(chunk.choices[0].text for chunk in oai.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
            if chunk.choices)
        assert streamed == reference[prompt]


def _scrape(url: str) -> tuple[dict, str]:
    with httpx.Client(timeout=30) as client:  # a new connection: either API server
        response = client.get(url + "/metrics")
    assert response.status_code == 200
    return parse(response.text)[0], response.headers[HEADER]


def _scrape_both(pair: ServerProcess) -> dict[str, dict]:
    """/metrics of each API server."""
    scrapes: dict[str, dict] = {}
    for index in ("0", "1"):
        with only_api_server(pair, index):
            samples, server = _scrape(pair.url)
        assert server == index
        scrapes[server] = samples
    return scrapes


def test_a_client_leaving_one_api_server_leaves_the_others_streams_alone(servers):
    pair, _ = servers
    url = pair.url
    before = _scrape(url)[0]
    max_tokens = 200

    async def run() -> dict[str, list[tuple[str, int]]]:
        """Six streams on each API server; one on API server 1 leaves after 3 chunks.

        API server 1's streams start last: API server 0 is paused (only_api_server) while
        they start, so its streams' tokens pile up and reach their client in a few merged
        chunks, too few to leave after the third under a loaded machine."""
        outcome: dict[str, list[tuple[str, int]]] = {"0": [], "1": []}
        left = asyncio.Event()

        async def start(index: int) -> tuple[httpx.AsyncClient, httpx.Response]:
            client = httpx.AsyncClient(base_url=url, timeout=60)
            body = {"model": "tiny", "prompt": PROMPTS[index % len(PROMPTS)],
                    "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            request = client.build_request("POST", "/v1/completions", json=body)
            return client, await client.send(request, stream=True)

        async def read(client: httpx.AsyncClient, response: httpx.Response) -> None:
            server = response.headers[HEADER]
            chunks, finish, tokens = 0, None, 0
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    chunks += 1
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                        finish = chunk["choices"][0]["finish_reason"]
                    if server == "1" and chunks == 3 and not left.is_set():
                        left.set()
                        outcome[server].append(("left", chunks))
                        return  # leaves mid-stream: the connection closes below
                outcome[server].append((finish or "none", tokens))
            finally:
                await response.aclose()
                await client.aclose()

        streams = []
        for index, numbers in (("0", range(6)), ("1", range(6, 12))):
            with only_api_server(pair, index):
                streams += await asyncio.gather(*(start(i) for i in numbers))
        assert [r.headers[HEADER] for _, r in streams] == ["0"] * 6 + ["1"] * 6
        await asyncio.gather(*(read(client, response) for client, response in streams))
        return outcome

    outcome = asyncio.run(run())
    assert len(outcome["0"]) == len(outcome["1"]) == 6 and ("left", 3) in outcome["1"], outcome
    finished = [result for results in outcome.values() for result in results
                if result != ("left", 3)]
    assert finished == [("length", max_tokens)] * len(finished), outcome

    # The leaver was aborted in the core: nothing runs or waits, no KV block is held
    # (the step metrics come from API server 0, /metrics of either renders them).
    def idle():
        samples = _scrape(url)[0]
        gauges = [value(samples, f"pagedserve:{name}") for name in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        aborted = (value(samples, "pagedserve:request_success_total", finished_reason="abort")
                   - value(before, "pagedserve:request_success_total",
                           finished_reason="abort"))
        return gauges == [0, 0, 0] and aborted >= 1
    wait_until(idle, timeout_s=30, what="the aborted request's KV blocks freed")


def test_metrics_from_either_api_server_count_both(servers):
    pair, _ = servers
    before = _scrape_both(pair)
    results = asyncio.run(_completions(pair.url, PROMPTS * 2, stream=False))
    served = {server for _, server in results}
    after = _scrape_both(pair)
    length = "pagedserve:request_success_total"
    for server in ("0", "1"):
        counted = (value(after[server], length, finished_reason="length")
                   - value(before[server], length, finished_reason="length"))
        assert counted == len(results), (server, counted, served)
        tokens = (value(after[server], "pagedserve:generation_tokens_total")
                  - value(before[server], "pagedserve:generation_tokens_total"))
        assert tokens == 12 * len(results)
    assert value(after["0"], "pagedserve:cache_config_info", num_blocks="128") == 1


def test_engine_death_is_reported_by_every_api_server(servers):
    pair, _ = servers
    core_pid = next(int(m.group(1)) for line in pair.lines
                    if (m := re.search(r"engine core pid (\d+)", line)))
    os.kill(core_pid, signal.SIGKILL)
    answers: dict[str, tuple[int, int]] = {}  # API server -> (/health, completion) status

    def both_report_it() -> bool:
        with httpx.Client(timeout=30) as client:  # a new connection: either API server
            health = client.get(pair.url + "/health")
            completion = client.post(pair.url + "/v1/completions", json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 2})
        answers[health.headers[HEADER]] = (health.status_code, completion.status_code)
        return set(answers) == {"0", "1"} and all(
            statuses == (503, 503) for statuses in answers.values())

    wait_until(both_report_it, timeout_s=30, what="503 from both API servers")
    assert any("the engine core process exited" in line for line in pair.lines)


def test_sigterm_stops_every_process(servers):
    pair, _ = servers
    launcher = pair.process.pid
    children = _children(launcher)
    assert len(children) >= 3, children  # the engine core and two API servers (+ tracker)
    metrics_dirs = set()
    for child in children:
        try:
            with open(f"/proc/{child}/environ", "rb") as environ:
                for item in environ.read().split(b"\0"):
                    if item.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
                        metrics_dirs.add(item.split(b"=", 1)[1].decode())
        except OSError:
            pass
    assert len(metrics_dirs) == 1 and all(os.path.isdir(d) for d in metrics_dirs)
    pair.process.send_signal(signal.SIGTERM)
    try:
        assert pair.process.wait(30) == 0, "\n".join(pair.lines[-30:])
    except subprocess.TimeoutExpired:
        pair.process.kill()
        raise
    wait_until(lambda: not any(_alive(pid) for pid in children), timeout_s=10,
               what="every child process gone")
    assert not any(os.path.isdir(d) for d in metrics_dirs)
    assert any("server stopped" in line and "api-server" not in line for line in pair.lines)


def test_health_of_a_frontend_without_requests_while_the_shared_core_is_in_a_long_step():
    """No answer to a ping, no request of its own, a step heard of 5 s ago: a frontend
    that shares the core counts it busy (another frontend's long step); a sole one stuck."""
    from engine.frontend.async_engine import AsyncEngine, EngineUnresponsiveError
    from engine.outputs import KVCacheInfo

    class Client:
        kv_cache_info = KVCacheInfo(num_blocks=8, block_size=16, max_model_len=64,
                                    vocab_size=32)

        def __init__(self, shares_core: bool):
            self.shares_core = shares_core
            self.last_message_time = time.monotonic() - 5.0

        def check_alive(self) -> None:
            pass

        async def ping_async(self, timeout_s: float) -> bool:
            return False

    async def health(shares_core: bool) -> None:
        engine = AsyncEngine(Client(shares_core), tokenizer=None)  # type: ignore[arg-type]
        await engine.check_health(ping_timeout_s=0.01, step_timeout_s=60.0)

    asyncio.run(health(True))
    with pytest.raises(EngineUnresponsiveError):
        asyncio.run(health(False))
