"""An inference request's life at the HTTP edge: admission, deadline, shutdown drain.

    HTTP request ──▶ ShutdownGate: draining? ─────────────────────────▶ 503 server_shutting_down
                     handler: validate, tokenize
                     Lifecycle.start(): queued + its sequences > --max-queued-requests?
                                                                      ──▶ 503 overloaded
                                        engine.add_request() per prompt
                                        ──▶ ActiveRequest (deadline timer: --request-timeout)
                     handler streams / collects; ActiveRequest.finish() at the end

    SIGTERM ──▶ Lifecycle.drain(--shutdown-timeout): refuse new requests, wait for the
                in-flight ones, then abort the rest (finish_reason "abort")

"Queued" is what the engine core has not scheduled yet: the engine's unscheduled
sequences plus the sequences of requests admitted here but not yet handed to the engine.
A request is admitted or refused at once (503 with Retry-After); nothing waits here. A
request larger than the whole queue is admitted only into an empty queue, so it is not
refused forever.

An ActiveRequest the server aborts (deadline, shutdown) ends like a client abort in the
engine (finish_reason "abort"); `error()` is what the client is told besides.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import byte_size, option, positive_int, positive_seconds
from engine.frontend.async_engine import AsyncEngine, RequestStream
from engine.lora_request import LoRARequest
from engine.multimodal.inputs import ImageFeature
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from server.common.api_label import GENERATION_PATHS
from server.common.errors import APIError

logger = logging.getLogger("pagedserve")

# Paths whose requests the drain waits for (everything but the probes and scrapes).
_UNTRACKED_PATHS = frozenset({"/health", "/metrics", "/version"})
# Paths whose refusals count as failed inference requests in the metrics.
_INFERENCE_PATHS = GENERATION_PATHS


def max_logprobs_value(text: str) -> int:
    """--max-logprobs: 0..engine.sampling_params.MAX_LOGPROBS."""
    from engine.sampling_params import MAX_LOGPROBS

    value = int(text)
    if not 0 <= value <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_LOGPROBS}, got {value}")
    return value


def images_per_prompt(text: str) -> int:
    """--limit-mm-per-prompt: "4", or vLLM's JSON '{"image": 4}'."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a number or {{\"image\": N}}, got {text!r}") \
            from None
    if isinstance(value, dict):
        unknown = set(value) - {"image"}
        if unknown:
            raise argparse.ArgumentTypeError(
                f"only images are served; {', '.join(sorted(unknown))} cannot be limited")
        value = value.get("image", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise argparse.ArgumentTypeError(f"the limit must be a whole number >= 0, got {text!r}")
    return value


def gibibytes(text: str) -> int:
    """--mm-processor-cache-gb: GiB (a float >= 0) as bytes."""
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of GiB >= 0, got {text}")
    return int(value * (1 << 30))


def domain_list(text: str) -> list[str]:
    """--allowed-media-domains: comma-separated host names."""
    return [part.strip().lower() for part in text.split(",") if part.strip()]


@dataclass(frozen=True)
class ServerLimits:
    """Caps an operator sets (`pagedserve serve` flags) and a client cannot exceed."""

    max_queued_requests: int = option(  # sequences not yet scheduled (see the module doc)
        1024, "--max-queued-requests", "Most sequences waiting to be scheduled (in the engine "
        "or on their way to it); a request beyond that is refused with 503 and Retry-After.",
        group="limits", type=positive_int)
    max_n: int = option(16, "--max-n", "Most choices ('n') one request may ask for.",
                        group="limits", type=positive_int)
    max_logprobs: int = option(
        20, "--max-logprobs", "Most logprobs (top alternatives per token) a request may ask "
        "for.", group="limits", type=max_logprobs_value)
    max_prompts_per_request: int = option(
        256, "--max-prompts-per-request", "Most prompts in one /v1/completions request.",
        group="limits", type=positive_int)
    max_request_body_bytes: int = option(
        32 << 20, "--max-request-body-bytes", "Largest request body, with an optional K/M/G "
        "suffix; larger ones get 413.", group="limits", type=byte_size, default_text="32M")
    max_header_bytes: int = option(
        64 << 10, "--max-header-bytes", "Largest request head (request line and headers), "
        "with an optional K/M/G suffix; larger ones are refused.", group="limits",
        type=byte_size, default_text="64K")
    request_timeout_s: float | None = option(  # None: no deadline
        None, "--request-timeout", "Abort a request still running after this many seconds "
        "(finish_reason 'abort' and a request_timeout error). Default: no deadline.",
        group="limits", type=positive_seconds)
    retry_after_s: int = 1  # the Retry-After of an overload answer
    # The Responses API's store of responses (server/apis/responses/store.py).
    responses_store_size: int = option(  # 0: nothing is stored
        1024, "--responses-store-size", "Most responses the Responses API keeps (store: true) "
        "for GET /v1/responses/{id} and previous_response_id; the oldest goes first (0: keep "
        "none).", group="limits", type=int)
    responses_store_ttl_s: float = option(
        3600.0, "--responses-store-ttl", "Seconds a stored response is kept.", group="limits",
        type=positive_seconds)
    # Images in (server/chat/images.py, server/common/images.py).
    max_images_per_prompt: int = option(
        8, "--limit-mm-per-prompt", "Vision models: most images in one request: a number, or "
        "vLLM's JSON '{\"image\": 4}'.", group="limits", type=images_per_prompt)
    max_image_pixels: int = option(
        36_000_000, "--max-image-pixels", "Largest decoded image (width x height); larger "
        "ones (and decompression bombs) get 400.", group="limits", type=positive_int)
    allow_remote_images: bool = option(
        False, "--allow-remote-images", "Fetch http(s) image URLs from public hosts (default: "
        "only data: URLs); loopback and private addresses stay refused.", group="limits")
    allowed_media_domains: list[str] = option(
        None, "--allowed-media-domains", "Fetch http(s) image URLs from these hosts only "
        "(and their subdomains); implies --allow-remote-images. Comma-separated.",
        group="limits", type=domain_list, default_factory=list)
    mm_processor_cache_bytes: int = option(
        1 << 30, "--mm-processor-cache-gb", "Vision models: GiB of processed images (resized, "
        "split, as the model's processor leaves them) kept by content hash, so a repeated "
        "image is not processed again (0: none).", group="limits", type=gibibytes,
        default_text="1")


def record_failure(metrics: Any, reason: str, count: int = 1) -> None:
    """`metrics.record_request_failure(reason)` `count` times, if the metrics have it."""
    record = getattr(metrics, "record_request_failure", None)
    if record is None:
        return
    try:
        for _ in range(count):
            record(reason)
    except Exception:  # noqa: BLE001 - metrics must never break serving
        logger.exception("record_request_failure(%r) failed", reason)


def shutting_down_error() -> APIError:
    return APIError(503, "The server is shutting down and accepts no new requests; retry "
                         "on another replica or later.", code="server_shutting_down",
                    headers={"Retry-After": "1", "Connection": "close"})


class ActiveRequest:
    """One HTTP request's engine requests (one stream per prompt) while they run."""

    def __init__(self, lifecycle: Lifecycle, streams: list[RequestStream]):
        self.lifecycle = lifecycle
        self.streams = streams
        self.abort_reason: str | None = None  # "timeout" | "shutdown"
        self._timer: asyncio.TimerHandle | None = None
        self._finished = False

    def abort(self, reason: str) -> None:
        """Abort every unfinished stream; each ends with finish_reason "abort"."""
        if self.abort_reason is not None or self._finished:
            return
        self.abort_reason = reason
        engine = self.lifecycle.engine
        for stream in self.streams:
            engine.abort_request(stream.req_id)
        if reason == "timeout":
            logger.warning("request %s exceeded the request timeout (%.1f s); aborted",
                           self.streams[0].req_id if self.streams else "?",
                           self.lifecycle.limits.request_timeout_s or 0.0)

    def error(self) -> APIError | None:
        """What the client is told when the server aborted the request, else None."""
        if self.abort_reason == "timeout":
            return APIError(
                504, f"The request exceeded the server's request timeout of "
                     f"{self.lifecycle.limits.request_timeout_s:g} s and was aborted "
                     f"(finish_reason 'abort').", code="request_timeout")
        if self.abort_reason == "shutdown":
            return APIError(503, "The server is shutting down; the request was aborted "
                                 "(finish_reason 'abort'). Retry it.",
                            code="server_shutting_down", headers={"Retry-After": "1"})
        return None

    async def finish(self) -> None:
        """Stop the deadline, abort whatever is unfinished, forget the request. Idempotent."""
        if self._finished:
            return
        self._finished = True
        if self._timer is not None:
            self._timer.cancel()
        for stream in self.streams:
            await stream.aclose()
        self.lifecycle.active.discard(self)


class Lifecycle:
    def __init__(self, engine: AsyncEngine, limits: ServerLimits, metrics: Any = None):
        self.engine = engine
        self.limits = limits
        self.metrics = metrics
        self.draining = False
        self.active: set[ActiveRequest] = set()
        self.num_http_in_flight = 0  # requests past the gate, probes excepted
        self._num_pending_sequences = 0  # admitted, not yet in the engine

    @property
    def num_queued_sequences(self) -> int:
        return self.engine.num_queued_sequences + self._num_pending_sequences

    def _admit(self, num_prompts: int, num_sequences: int) -> None:
        if self.draining:
            record_failure(self.metrics, "overload", num_prompts)
            raise shutting_down_error()
        queued = self.num_queued_sequences
        limit = self.limits.max_queued_requests
        if queued > 0 and queued + num_sequences > limit:
            record_failure(self.metrics, "overload", num_prompts)
            raise APIError(
                503, f"The server is overloaded: {queued} sequences are waiting to be "
                     f"scheduled (limit {limit}, --max-queued-requests) and this request "
                     f"adds {num_sequences}. Retry after a moment.",
                code="server_overloaded", headers={"Retry-After": str(self.limits.retry_after_s)})

    async def start(
        self,
        requests: Sequence[tuple[str, list[int], str | None]],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[ImageFeature] | None = None,
    ) -> ActiveRequest:
        """Admit the request (or raise a 503 APIError) and queue its engine requests.

        `requests`: (engine request id, prompt token ids, prompt text or None) each;
        `pooling_params`: they are pooling requests (embeddings): one PoolingParams for
        all, or one each. `mm_features`: the images of the (one) prompt.
        The caller owns the result: it must `finish()` it.
        """
        num_sequences = len(requests) * params.n
        self._admit(len(requests), num_sequences)
        self._num_pending_sequences += num_sequences
        streams: list[RequestStream] = []
        try:
            for index, (req_id, token_ids, text) in enumerate(requests):
                pooling = (pooling_params[index] if isinstance(pooling_params, Sequence)
                           else pooling_params)
                streams.append(await self.engine.add_request(
                    token_ids, params, req_id, prompt_text=text, priority=priority,
                    cache_salt=cache_salt, pooling_params=pooling,
                    lora_request=lora_request, mm_features=mm_features))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        finally:
            self._num_pending_sequences -= num_sequences
        active = ActiveRequest(self, streams)
        self.active.add(active)
        timeout = self.limits.request_timeout_s
        if timeout is not None:
            active._timer = asyncio.get_running_loop().call_later(
                timeout, active.abort, "timeout")
        return active

    # ------------------------------------------------------------------ shutdown
    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; wait up to `timeout_s` for the in-flight ones to finish,
        then abort the rest and give their responses a moment to go out."""
        self.draining = True
        if self.num_http_in_flight or self.engine.num_unfinished_requests:
            logger.info("shutting down: refusing new requests; waiting up to %.1f s for %d "
                        "in-flight request(s)", timeout_s, self.num_http_in_flight)
        else:
            logger.info("shutting down: no requests in flight")
        deadline = time.monotonic() + timeout_s
        while self.num_http_in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        unfinished = self.engine.num_unfinished_requests
        if self.active or unfinished:
            logger.warning("shutdown timeout (%.1f s) reached: aborting %d unfinished "
                           "request(s)", timeout_s, max(len(self.active), unfinished))
            for active in list(self.active):
                active.abort("shutdown")
            for req_id in self.engine.unfinished_req_ids:  # any the HTTP layer did not own
                self.engine.abort_request(req_id)
            deadline = time.monotonic() + 2.0  # let the aborted responses be written
            while self.num_http_in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        if self.num_http_in_flight:
            logger.warning("%d response(s) still open at shutdown; they will be cut",
                           self.num_http_in_flight)


class ShutdownGate:
    """ASGI middleware: 503 for new requests while draining; counts the ones in flight."""

    def __init__(self, app, lifecycle: Lifecycle):
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in _UNTRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        lifecycle = self.lifecycle
        if lifecycle.draining:
            if scope.get("path") in _INFERENCE_PATHS:
                record_failure(lifecycle.metrics, "overload")
            await shutting_down_error().to_response(scope.get("path"))(scope, receive, send)
            return
        lifecycle.num_http_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            lifecycle.num_http_in_flight -= 1
