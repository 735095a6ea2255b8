"""One access-log line per HTTP request, written when its response is complete.

    127.0.0.1:51234 "POST /v1/completions HTTP/1.1" 200 api=openai_completions prompt_tokens=12 completion_tokens=30 0.412s

A pure ASGI middleware (it wraps `send`), so a streamed response is logged when its
last chunk is sent, with the latency of the whole stream. Handlers report token
counts by setting `request.state.usage` (a UsageInfo).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("pagedserve.access")


class AccessLogMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0
        logged = False

        def log(note: str = "") -> None:
            nonlocal logged
            if logged:
                return
            logged = True
            client = scope.get("client")
            peer = f"{client[0]}:{client[1]}" if client else "-"
            path = scope.get("path", "")
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
            line = f'{peer} "{scope.get("method", "")} {path} HTTP/{scope.get("http_version", "1.1")}" {status}'
            state = scope.get("state") or {}
            if state.get("api"):
                line += f" api={state['api']}"
            usage = state.get("usage")
            if usage is not None:
                line += (f" prompt_tokens={usage.prompt_tokens}"
                         f" completion_tokens={usage.completion_tokens}")
            if state.get("user"):
                line += f" user={state['user']!r}"
            if state.get("stream_error"):
                note = note or "stream_error"
            line += f" {time.perf_counter() - started:.3f}s"
            if note:
                line += f" ({note})"
            logger.info(line)

        async def send_and_log(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log()

        try:
            await self.app(scope, receive, send_and_log)
        except BaseException:
            status = status or 500
            log("failed")
            raise
        finally:
            log("client disconnected" if status else "no response")
