"""x-ray server helpers: a server under load, and waiting for it.

Shared by tests/server/test_xray_server.py and test_xray_browser.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import httpx

from server.common.state import XrayOptions
from tests.support.server_fixtures import (
    ServerThread,
    build_fake_server,
)

SYSTEM_PROMPT = ("You are a helpful assistant. Paged attention stores the KV cache in "
                 "fixed-size blocks; a shared system prompt is cached once. ") * 3


DEADLINE_S = 60


def chat_body(index: int, max_tokens: int) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": f"Question {index}: hello there {index}?"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "user": f"client-user-{index}"}


class Load:
    """Chat requests sharing SYSTEM_PROMPT, sent from a background thread."""

    def __init__(self, url: str, num_requests: int, max_tokens: int, api_key: str | None = None,
                 spacing_s: float = 0.0):
        self.statuses: list[int] = []
        headers = {"X-Request-Id": "client-chosen-id"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"

        async def run() -> None:
            async with httpx.AsyncClient(timeout=DEADLINE_S * 4, headers=headers) as client:
                async def one(index: int) -> None:
                    await asyncio.sleep(index * spacing_s)
                    response = await client.post(url + "/v1/chat/completions",
                                                 json=chat_body(index, max_tokens))
                    self.statuses.append(response.status_code)

                await asyncio.gather(*(one(i) for i in range(num_requests)))

        self.thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(DEADLINE_S * 4)
        assert not self.thread.is_alive() and set(self.statuses) == {200}, self.statuses


def wait_for(predicate, what: str, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def start_server(tokenizer_dir, xray: XrayOptions, *, max_model_len: int = 512,
                 max_num_seqs: int = 4, executor_kwargs: dict | None = None,
                 **options) -> ServerThread:
    """A real server over the echo FakeExecutor (20 ms steps) with these x-ray options."""
    server = build_fake_server(
        tokenizer_dir, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        executor_kwargs=executor_kwargs or {"step_delay_s": 0.02, "num_blocks": 256}, **options)
    server.options = dataclasses.replace(server.options, xray=xray)
    return ServerThread(server).start()
