"""GET /xray (a live page of the engine) and GET /xray/state (its JSON), over one cache.

    viewers ─▶ GET /xray/state ─▶ SnapshotCache.get()
                                    younger than its interval?  the cached JSON bytes
                                    else one refresh, shared by every waiting viewer:
                                      XrayCall ─▶ engine core (between two steps)
                                      ─▶ XraySnapshot (engine/xray_schema.py) ─▶ JSON, cached

However many viewers poll, the core builds at most one snapshot per interval: at least
`min_interval_s`, and long enough that building snapshots takes at most `max_core_share`
of the core's time (a huge pool is snapshotted less often), up to `max_interval_s`.
Prompt and output text are added here, never in the core, and only with
--xray-show-text. Both routes need the API key when the server has one: as
`Authorization: Bearer <key>` or as the password of HTTP Basic auth, which a browser asks
for (a page cannot send a bearer token when it is opened). --no-xray leaves both routes
out.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import math
import statistics
import time
from collections import deque
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from engine.xray_schema import XraySnapshot
from server.common.api_label import api_of_request_id
from server.common.errors import APIError, from_exception
from server.common.state import XrayOptions

if TYPE_CHECKING:
    from engine.frontend.async_engine import AsyncEngine

PAGE_RESOURCE = "static/xray.html"
_NO_STORE = {"Cache-Control": "no-store"}
# The page loads nothing from elsewhere (no CDN): everything is inline in one file.
_PAGE_HEADERS = {
    **_NO_STORE,
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "img-src data:; connect-src 'self'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_BASIC_CHALLENGE = 'Basic realm="pagedserve x-ray", charset="UTF-8"'


class SnapshotCache:
    """The latest snapshot as JSON bytes, shared by every viewer (see the module doc)."""

    def __init__(self, engine: AsyncEngine, options: XrayOptions, model: str,
                 tokenizer: Any = None):
        self._engine = engine
        self._options = options
        self._model = model
        self._tokenizer = tokenizer
        self.interval_s = options.min_interval_s
        self.num_refreshes = 0
        self._build_s: deque[float] = deque(maxlen=5)  # the core's cost of recent snapshots
        self._body: bytes | None = None
        self._taken_at = -math.inf  # time.monotonic() of the cached snapshot
        self._refresh: asyncio.Task | None = None
        self._prompt_texts: dict[str, str] = {}  # req_id -> shown prompt (show_text only)

    async def get(self) -> bytes:
        """The cached JSON, refreshed first if older than `interval_s`. Raises
        asyncio.TimeoutError if the core does not answer within `timeout_s`, or what
        AsyncEngine.xray_snapshot raises."""
        if self._body is not None and time.monotonic() - self._taken_at < self.interval_s:
            return self._body
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self._take())
            # Retrieved here, so a refresh that every waiter gave up on logs no warning.
            self._refresh.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.wait_for(asyncio.shield(self._refresh), self._options.timeout_s)

    async def _take(self) -> bytes:
        snapshot = await self._engine.xray_snapshot(self._options.limits)
        self.num_refreshes += 1
        # The median of recent costs, so one snapshot slowed by a busy machine does not
        # stretch the interval.
        self._build_s.append(snapshot.build_ms / 1000.0)
        options = self._options
        self.interval_s = min(max(options.min_interval_s,
                                  statistics.median(self._build_s) / options.max_core_share),
                              options.max_interval_s)
        snapshot.model = self._model
        snapshot.show_text = self._options.show_text
        snapshot.min_interval_s = self.interval_s
        for request in (*snapshot.running, *snapshot.waiting):
            request.api = api_of_request_id(request.req_id)
        if self._options.show_text:
            self._add_text(snapshot)
        self._body = msgspec.json.encode(snapshot)
        self._taken_at = time.monotonic()
        return self._body

    def _add_text(self, snapshot: XraySnapshot) -> None:
        limit = self._options.max_text_chars
        prompts: dict[str, str] = {}
        for request in (*snapshot.running, *snapshot.waiting):
            known = self._engine.sequence_text(request.req_id)
            if known is None:
                continue
            prompt, prompt_token_ids, output = known
            shown = self._prompt_texts.get(request.req_id)
            if shown is None:
                if prompt is None and self._tokenizer is not None:
                    prompt = self._tokenizer.decode(prompt_token_ids)
                shown = _head(prompt or "", limit)
            prompts[request.req_id] = shown
            request.prompt_text = shown
            request.output_text = _tail(output, limit)
        self._prompt_texts = prompts  # only the requests still listed


def _head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "…" + text[-limit:]


def authorized(header: str | None, api_key: str | None) -> bool:
    """True if `header` (Authorization) carries `api_key`: `Bearer <key>`, or HTTP Basic
    with the key as the password (any user name). No key set: always True."""
    if api_key is None:
        return True
    scheme, _, value = (header or "").partition(" ")
    if scheme.lower() == "bearer":
        given = value.strip()
    elif scheme.lower() == "basic":
        try:
            given = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except ValueError:  # bad base64 (binascii.Error) or bad UTF-8
            return False
    else:
        return False
    return hmac.compare_digest(given.encode(), api_key.encode())


def _unauthorized() -> Response:
    response = APIError(
        401, "Invalid or missing API key: send 'Authorization: Bearer <key>', or give the "
             "key as the password when the browser asks.", code="invalid_api_key").to_response()
    response.headers["WWW-Authenticate"] = _BASIC_CHALLENGE  # browsers prompt for Basic
    return response


def load_page() -> str:
    """The page, shipped in the package (server/http/static/xray.html)."""
    return resources.files("server.http").joinpath(PAGE_RESOURCE).read_text(encoding="utf-8")


class XrayHost(Protocol):
    """What the x-ray routes read of the server's state (server.common.state.ServerState, which
    holds this module's XrayOptions: so this module names it only by shape)."""

    xray: XrayOptions
    engine: AsyncEngine
    tokenizer: Any
    api_key: str | None

    @property
    def model_name(self) -> str: ...


def install_xray_routes(app: FastAPI, state: XrayHost) -> SnapshotCache | None:
    """Add GET /xray and GET /xray/state unless --no-xray; returns their cache."""
    options = state.xray
    if not options.enabled:
        return None
    cache = SnapshotCache(state.engine, options, state.model_name, state.tokenizer)
    page = load_page()

    @app.get("/xray", include_in_schema=False)
    async def xray_page(request: Request) -> Response:
        if not authorized(request.headers.get("authorization"), state.api_key):
            return _unauthorized()
        return HTMLResponse(page, headers=_PAGE_HEADERS)

    @app.get("/xray/state", include_in_schema=False)
    async def xray_state(request: Request) -> Response:
        """The engine x-ray snapshot as JSON (schema: docs/xray.md)."""
        if not authorized(request.headers.get("authorization"), state.api_key):
            return _unauthorized()
        try:
            body = await cache.get()
        except asyncio.TimeoutError:
            raise APIError(503, f"The engine core did not answer within "
                                f"{options.timeout_s:g} s (a long step?); try again.",
                           code="engine_busy") from None
        except Exception as exc:
            raise from_exception(exc) from exc
        return Response(body, media_type="application/json", headers=_NO_STORE)

    return cache
