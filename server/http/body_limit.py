"""ASGI middleware: refuse request heads over `--max-header-bytes` (431) and bodies over
`--max-request-body-bytes` (413), with an OpenAI error object.

Heads: uvicorn's h11 `max_incomplete_event_size` (set to the same limit) bounds what it
buffers while a head arrives; a head that arrived in one piece is measured here.
Bodies are read here, counted as they arrive, and handed on in one piece; the limit
holds with or without a Content-Length (a declared length over the limit is refused
before reading anything). After the body, `receive` passes through, so handlers still
see the client's disconnect.
"""

from __future__ import annotations

from typing import Any

from server.common.errors import APIError


def _declared_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class RequestSizeLimit:
    def __init__(self, app, max_body_bytes: int, max_header_bytes: int, metrics: Any = None):
        self.app = app
        self.max_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.metrics = metrics

    async def _refuse(self, scope, receive, send, size: str) -> None:
        await self._answer(scope, receive, send, APIError(
            413, f"The request body is too large ({size}; the limit is {self.max_bytes} "
                 f"bytes, --max-request-body-bytes).", code="request_too_large",
            headers={"Connection": "close"}))

    async def _answer(self, scope, receive, send, error: APIError) -> None:
        record = getattr(self.metrics, "record_error", None)
        if record is not None:
            try:
                record(error, scope.get("path"))
            except Exception:  # noqa: BLE001 - metrics must never break serving
                pass
        await error.to_response(scope.get("path"))(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head_bytes = len(scope.get("raw_path") or b"") + len(scope.get("query_string", b""))
        head_bytes += sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ()))
        if head_bytes > self.max_header_bytes:
            await self._answer(scope, receive, send, APIError(
                431, f"The request headers are too large ({head_bytes} bytes; the limit is "
                     f"{self.max_header_bytes}, --max-header-bytes).",
                code="request_header_too_large", headers={"Connection": "close"}))
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"{declared} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                await self.app(scope, _replay([], message, receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([first], None, receive), send)


def _replay(messages: list[dict], last: dict | None, receive):
    """A `receive` that returns `messages` (then `last`, if any), then delegates."""
    queue = list(messages) + ([last] if last is not None else [])

    async def replay_receive():
        if queue:
            return queue.pop(0)
        return await receive()

    return replay_receive
