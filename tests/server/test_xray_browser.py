"""The /xray page in a real browser: Debian's headless Chromium, driven by Selenium through
the system's chromedriver (a browser download at test time is not possible here).

While chat requests sharing one system prompt run on a real server (echo FakeExecutor),
the page must show the running requests; the numbers it shows must equal /xray/state's
(the same snapshot) and /metrics' (running, waiting exactly; blocks in use within what a
few steps can allocate); the prefix tree must be one shared trunk that branches; the
browser must log no error. A screenshot goes to the test's tmp dir, and to
$PAGEDSERVE_XRAY_SCREENSHOT when set (docs/xray.png is made that way).

Chromium and its driver are installed with apt-get when absent (as root); the test skips,
saying so, only when that is not possible.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from server.common.state import XrayOptions
from tests.support.server_fixtures import build_tokenizer_dir
from tests.support.xray_server import DEADLINE_S, Load, start_server, wait_for

MAX_NUM_SEQS = 8
NUM_REQUESTS = 16
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_chromium(install: bool = True) -> tuple[str, str] | None:
    """(browser, chromedriver) paths; installs Debian's `chromium` and `chromium-driver`
    with apt-get when absent (as root). None when they cannot be had here."""

    def find() -> tuple[str, str] | None:
        browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
        driver = shutil.which("chromedriver")
        return (browser, driver) if browser and driver else None

    found = find()
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if found is None and install and is_root and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium",
                   "chromium-driver"]
        try:
            if subprocess.run(command, env=env, capture_output=True, timeout=900).returncode:
                subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True,
                               timeout=600)
                subprocess.run(command, env=env, capture_output=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired):
            pass
        found = find()
    return found


@pytest.fixture(scope="module")
def driver():
    paths = find_chromium()
    if paths is None:
        pytest.skip("no Chromium: install Debian's 'chromium' and 'chromium-driver' packages "
                    "(this test installs them itself when it runs as root with apt-get)")
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is in the test extras: pip install -e '.[test]'")
    from selenium.webdriver.chrome.service import Service

    browser, chromedriver = paths
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1440,1450"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    yield chrome
    chrome.quit()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("xray-browser-tok"))


@pytest.fixture(scope="module")
def server(tokenizer_dir):
    thread = start_server(tokenizer_dir, XrayOptions(), max_num_seqs=MAX_NUM_SEQS,
                          shutdown_timeout_s=0.5,
                          executor_kwargs={"step_delay_s": 0.02, "num_blocks": 384},
                          max_model_len=1024)
    yield thread
    thread.stop()


# One atomic read of what the page shows.
READ_DOM = """
const value = (id) => Number(document.getElementById(id).dataset.value);
const segs = [...document.querySelectorAll('#prefix-tree g.seg')];
const roots = segs.filter((g) => g.dataset.root === '1');
return {
  seq: Number(document.getElementById('snapshot-seq').dataset.seq || 0),  // 0: none yet
  running: value('num-running'), waiting: value('num-waiting'),
  in_use: value('num-blocks-in-use'), free_cached: value('num-free-cached'),
  running_rows: [...document.querySelectorAll('#queue-rows tr[data-status=running]')]
      .map((tr) => tr.dataset.reqId),
  waiting_rows: document.querySelectorAll(
      '#queue-rows tr[data-status=waiting], #queue-rows tr[data-status=preempted]').length,
  num_roots: Number(document.getElementById('prefix-tree').dataset.numRoots),
  root: roots.length ? {...roots[0].dataset} : null,
  map_height: document.getElementById('block-map').height,
  timeline_bars: document.querySelectorAll('#timeline rect').length,
};
"""


def metric(text: str, name: str) -> float:
    match = re.search(rf"^pagedserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_page_under_load(server, driver, tmp_path):
    url = server.url
    # Spaced a little, so that every request after the first finds the system prompt cached.
    load = Load(url, num_requests=NUM_REQUESTS, max_tokens=400, spacing_s=0.05)
    try:
        wait_for(lambda: httpx.get(url + "/xray/state").json()["num_waiting"]
                 == NUM_REQUESTS - MAX_NUM_SEQS, "the load to be queued")
        driver.get(url + "/xray")
        wait_for(lambda: len(driver.execute_script(READ_DOM)["running_rows"]) == MAX_NUM_SEQS,
                 "the page to show the running requests")
        for _ in range(50):  # until the page shows the very snapshot /xray/state serves
            dom = driver.execute_script(READ_DOM)
            state = httpx.get(url + "/xray/state", timeout=DEADLINE_S).json()
            metrics = httpx.get(url + "/metrics", timeout=DEADLINE_S).text
            if state["seq"] == dom["seq"]:
                break
            time.sleep(0.07)
        else:
            pytest.fail("the page never showed the snapshot /xray/state served")

        blocks = state["blocks"]
        assert (dom["running"], dom["waiting"]) == (state["num_running"], state["num_waiting"])
        assert (dom["running"], dom["waiting"]) == (MAX_NUM_SEQS, NUM_REQUESTS - MAX_NUM_SEQS)
        assert (dom["in_use"], dom["free_cached"]) == (blocks["num_in_use"],
                                                       blocks["num_free_cached"])
        assert dom["running_rows"] == [r["req_id"] for r in state["running"]]
        assert dom["waiting_rows"] == len(state["waiting"])
        # /metrics is updated by every step: the same queues (steady here), and as many
        # blocks in use as a few steps' growth allows (a new block every 16 tokens).
        assert metric(metrics, "num_requests_running") == dom["running"]
        assert metric(metrics, "num_requests_waiting") == dom["waiting"]
        metrics_in_use = metric(metrics, "kv_cache_usage_perc") * blocks["num_blocks"]
        assert abs(metrics_in_use - dom["in_use"]) <= 2 * MAX_NUM_SEQS, (metrics_in_use, dom)

        # The system prompt is one trunk, held by every running request, that branches.
        tree = state["prefix_tree"]
        assert dom["num_roots"] == tree["num_roots"] == 1
        root = dom["root"]
        assert int(root["refCnt"]) == tree["nodes"][0]["ref_cnt"] == MAX_NUM_SEQS
        assert int(root["hits"]) == tree["nodes"][0]["num_hits"] >= MAX_NUM_SEQS - 1
        assert int(root["blocks"]) >= 3 and int(root["children"]) >= 2
        assert dom["map_height"] > 0 and dom["timeline_bars"] > 0

        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        shot = tmp_path / "xray.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
        target = os.environ.get("PAGEDSERVE_XRAY_SCREENSHOT")
        if target:
            shutil.copyfile(shot, Path(target))
    finally:
        server.stop()  # aborts the rest of the load
        load.thread.join(DEADLINE_S)


def test_page_behind_api_key(driver, tokenizer_dir):
    """With --api-key the browser gives the key by HTTP Basic auth (here in the URL, as a
    login box would) and the page's own requests carry it."""
    thread = start_server(tokenizer_dir, XrayOptions(), api_key="browser-key",
                          shutdown_timeout_s=0.5)
    try:
        driver.get(thread.url + "/xray")  # no key: the browser's login box, not the page
        assert "snapshot-seq" not in driver.page_source
        driver.get(thread.url.replace("http://", "http://viewer:browser-key@") + "/xray")
        wait_for(lambda: driver.execute_script(READ_DOM)["seq"] > 0, "the page's first snapshot")
        assert driver.find_element("id", "status").text.startswith("live")
    finally:
        thread.stop()
