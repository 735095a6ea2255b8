"""GET /xray and /xray/state (server/http/xray.py): the shared snapshot cache, auth, privacy,
--no-xray, --xray-show-text; over a stub engine, and over a real server (HTTP, AsyncEngine,
engine-core process over the typed IPC) with the echo FakeExecutor under load."""

from __future__ import annotations

import asyncio
import base64
import re
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.core import EngineCore
from engine.request import EngineCoreRequest
from engine.sampling_params import SamplingParams
from engine.xray_schema import XrayLimits, XraySnapshot
from server.common.metrics import ServerMetrics
from server.common.state import ServerState, XrayOptions
from server.http.app import build_app
from server.http.cli import make_arg_parser
from server.http.xray import PAGE_RESOURCE, SnapshotCache, authorized, load_page
from tests.support.server_fixtures import (
    FakeExecutor,
    build_tokenizer_dir,
)
from tests.support.xray_server import DEADLINE_S, Load, start_server, wait_for

API_KEY = "xray-secret"


# --------------------------------------------------------------------------- helpers






def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# ----------------------------------------------------------------- over a stub engine
class StubEngine:
    """What the x-ray routes use of an AsyncEngine, over an in-process EngineCore."""

    max_model_len = 256
    vocab_size = 1000
    num_queued_sequences = 0

    def __init__(self, delay_s: float = 0.0):
        config = EngineConfig(model_config=ModelConfig(model="fake", max_model_len=256),
                              cache_config=CacheConfig(block_size=4),
                              scheduler_config=SchedulerConfig(max_num_seqs=4))
        self.core = EngineCore(config, FakeExecutor(config, vocab_size=1000, num_blocks=32))
        self.core.add_request(EngineCoreRequest(
            "cmpl-1-0", list(range(100, 110)),
            SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)))
        self.core.step()
        self.delay_s = delay_s
        self.num_calls = 0

    async def xray_snapshot(self, limits: XrayLimits) -> XraySnapshot:
        self.num_calls += 1
        await asyncio.sleep(self.delay_s)
        return self.core.xray_snapshot(limits)

    def sequence_text(self, req_id: str):
        return (None, [5, 6, 7], "x" * 500) if req_id == "cmpl-1-0" else None


class StubTokenizer:
    def decode(self, token_ids):
        return "decoded prompt " + "y" * 300


def stub_app(api_key: str | None = None, **xray) -> tuple[TestClient, StubEngine]:
    engine = StubEngine()
    state = ServerState(engine=engine, tokenizer=StubTokenizer(), served_model_names=["m"],
                        model_root="/m", metrics=ServerMetrics("m"), api_key=api_key,
                        xray=XrayOptions(**xray))
    return TestClient(build_app(state)), engine


def test_no_xray_removes_both_routes():
    client, engine = stub_app(enabled=False)
    for path in ("/xray", "/xray/state"):
        response = client.get(path)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert engine.num_calls == 0


def test_cli_flags():
    parser = make_arg_parser()
    assert (parser.parse_args([]).xray, parser.parse_args([]).xray_show_text) == (True, False)
    args = parser.parse_args(["--no-xray", "--xray-show-text"])
    assert (args.xray, args.xray_show_text) == (False, True)


def test_cli_environment(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_XRAY", "0")
    monkeypatch.setenv("PAGEDSERVE_XRAY_SHOW_TEXT", "1")
    args = make_arg_parser().parse_args([])
    assert (args.xray, args.xray_show_text) == (False, True)


def test_page_is_one_self_contained_file():
    client, _ = stub_app()
    response = client.get("/xray")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    assert page == load_page() and PAGE_RESOURCE == "static/xray.html"
    assert "default-src 'none'" in response.headers["content-security-policy"]
    assert response.headers["cache-control"] == "no-store"
    # Nothing loaded from elsewhere: no external scripts, styles, fonts or images.
    assert not re.search(r"<script[^>]+src=|<link|@import|url\(", page)
    assert set(re.findall(r"https?://[^\s\"')]+", page)) == {"http://www.w3.org/2000/svg"}
    for element_id in ("num-running", "num-waiting", "num-blocks-in-use", "snapshot-seq",
                       "queue-rows", "block-map", "prefix-tree", "timeline"):
        assert f'id="{element_id}"' in page


def test_state_json_and_error_objects():
    client, _ = stub_app()
    state = client.get("/xray/state", params={"ignored": "1"})
    assert state.status_code == 200 and state.headers["cache-control"] == "no-store"
    body = state.json()
    assert body["schema_version"] == 1 and body["model"] == "m" and body["show_text"] is False
    assert [r["req_id"] for r in body["running"]] == ["cmpl-1-0"]
    assert body["running"][0]["api"] == "openai_completions"  # from the id's prefix
    assert "prompt_text" not in body["running"][0] and "output_text" not in body["running"][0]
    wrong_method = client.post("/xray/state")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    missing = client.get("/xray/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_show_text_is_truncated_and_only_on_request():
    client, _ = stub_app(show_text=True, max_text_chars=20)
    (request,) = client.get("/xray/state").json()["running"]
    assert request["prompt_text"] == "decoded prompt yyyyy…"  # the head of the prompt
    assert request["output_text"] == "…" + "x" * 20  # the tail of the output


def test_auth_bearer_or_basic():
    client, engine = stub_app(api_key=API_KEY)
    for path in ("/xray", "/xray/state"):
        for header in (None, "Bearer wrong", basic("u", "wrong"), "Basic !!notbase64",
                       f"Basic {API_KEY}", "Token " + API_KEY):
            response = client.get(path, headers={"Authorization": header} if header else {})
            assert response.status_code == 401, (path, header)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"].startswith("Basic ")
        for header in (f"Bearer {API_KEY}", basic("anyone", API_KEY), basic("", API_KEY)):
            assert client.get(path, headers={"Authorization": header}).status_code == 200
    assert authorized(None, None) and not authorized(basic("a", "b:c"), "c")


def test_one_snapshot_shared_by_every_viewer():
    engine = StubEngine(delay_s=0.05)
    cache = SnapshotCache(engine, XrayOptions(min_interval_s=0.3), "m")

    async def main() -> None:
        bodies = await asyncio.gather(*(cache.get() for _ in range(50)))
        assert engine.num_calls == 1 and len(set(bodies)) == 1
        assert await cache.get() is bodies[0]  # still fresh: no new snapshot
        await asyncio.sleep(0.35)
        await asyncio.gather(*(cache.get() for _ in range(10)))
        assert engine.num_calls == 2

    asyncio.run(main())


def test_interval_grows_with_the_snapshot_cost():
    engine = StubEngine()
    options = XrayOptions(min_interval_s=0.25, max_core_share=0.01, max_interval_s=5.0)
    cache = SnapshotCache(engine, options, "m")
    real = engine.xray_snapshot

    async def costly(limits, build_ms):
        snapshot = await real(limits)
        snapshot.build_ms = build_ms
        return snapshot

    async def main() -> None:
        # Costs so far -> median -> interval: [1] 1 ms -> 0.1 s, raised to 0.25 s;
        # [1, 20] 10.5 ms -> 1.05 s; [1, 20, 20] 20 ms -> 2 s; ... [20, 20, 100, 100, 100]
        # (the last 5) 100 ms -> 10 s, capped at 5 s.
        for build_ms, interval_s in ((1.0, 0.25), (20.0, 1.05), (20.0, 2.0), (100.0, 2.0),
                                     (100.0, 2.0), (100.0, 5.0)):
            engine.xray_snapshot = lambda limits, ms=build_ms: costly(limits, ms)
            cache._taken_at = -1e9  # stale: refresh now
            await cache.get()
            assert cache.interval_s == pytest.approx(interval_s), build_ms

    asyncio.run(main())


def test_timeout_is_a_503_error_object():
    client, engine = stub_app(timeout_s=0.05)
    engine.delay_s = 0.5
    response = client.get("/xray/state")
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_busy"


# ------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("xray-tok"))




@pytest.fixture(scope="module")
def server(tokenizer_dir):
    thread = start_server(tokenizer_dir, XrayOptions(), api_key=API_KEY)
    yield thread
    thread.stop()


def get_state(url: str, **headers) -> dict:
    response = httpx.get(url + "/xray/state", timeout=DEADLINE_S,
                         headers={"Authorization": f"Bearer {API_KEY}", **headers})
    assert response.status_code == 200, response.text
    return response.json()


def test_real_server_under_load(server):
    url = server.url
    assert httpx.get(url + "/xray/state").status_code == 401
    load = Load(url, num_requests=8, max_tokens=40, api_key=API_KEY)
    state = wait_for(lambda: (s := get_state(url))["num_running"] == 4 and s, "4 running")
    assert state["config"]["max_num_seqs"] == 4 and state["num_waiting"] >= 1
    for request in state["running"] + state["waiting"]:
        # The server's own ids, whatever the client sent (X-Request-Id, user).
        assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", request["req_id"]), request["req_id"]
        assert "prompt_text" not in request and "output_text" not in request
    raw = httpx.get(url + "/xray/state", headers={"Authorization": f"Bearer {API_KEY}"}).text
    assert "helpful assistant" not in raw and "client-chosen-id" not in raw
    assert "client-user" not in raw
    tree = state["prefix_tree"]
    assert tree["num_roots"] == 1  # the shared system prompt: one trunk
    assert tree["nodes"][0]["ref_cnt"] >= 2
    blocks = state["blocks"]
    assert blocks["num_in_use"] == sum(r["num_blocks"] for r in state["running"]) - sum(
        n["ref_cnt"] - 1 for n in tree["nodes"] if n["ref_cnt"] > 1)
    # Many viewers at once share one snapshot.
    with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        seqs = set()

        def view() -> None:
            seqs.add(client.get(url + "/xray/state").json()["seq"])

        viewers = [threading.Thread(target=view) for _ in range(12)]
        for viewer in viewers:
            viewer.start()
        for viewer in viewers:
            viewer.join(DEADLINE_S)
        assert len(seqs) <= 2, seqs  # one snapshot (two if a refresh fell in between)
    load.join()
    state = wait_for(lambda: (s := get_state(url))["num_running"] == 0 and s, "idle")
    assert state["blocks"]["num_in_use"] == 0 and state["steps"]["step"]
    assert sum(state["steps"]["num_admitted"]) >= 8
    assert sum(state["steps"]["num_finished"]) >= 8


@pytest.fixture(scope="module")
def text_server(tokenizer_dir):
    thread = start_server(tokenizer_dir, XrayOptions(show_text=True))
    yield thread
    thread.stop()


def test_real_server_show_text(text_server):
    url = text_server.url
    load = Load(url, num_requests=2, max_tokens=80)
    state = wait_for(
        lambda: (s := httpx.get(url + "/xray/state", timeout=DEADLINE_S).json())["running"]
        and all(r.get("output_text") for r in s["running"]) and s, "text of running requests")
    assert state["show_text"] is True
    for request in state["running"]:
        assert request["api"] == "openai_chat"
        assert request["prompt_text"].startswith("<|im_start|>system\nYou are a helpful")
        assert request["prompt_text"].endswith("…")
    load.join()
