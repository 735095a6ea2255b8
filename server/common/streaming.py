"""Response plumbing every API shares: SSE framing, compact JSON, and the guarantees that a
request ends when its client leaves (EngineStreamingResponse, run_until_disconnect,
collect_final)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.request_output import RequestOutput
from server.common.errors import from_exception
from server.common.lifecycle import ActiveRequest

T = TypeVar("T")


# Characters that JSON leaves raw but Python's str.splitlines (and so httpx's iter_lines,
# and many line-based SSE readers) treats as line breaks: one in a token would cut an
# event in two for those clients. Escaped, the JSON value is the same.
_LINE_BREAKS_JSON_KEEPS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def sse(data_json: str) -> str:
    r"""One SSE event carrying `data_json`, safe for line-splitting clients.

    Example: {"c":"a<U+2028>b"} -> data: {"c":"a\u2028b"}  (then a blank line).
    """
    if not data_json.isascii():
        for raw, escaped in _LINE_BREAKS_JSON_KEEPS.items():
            if raw in data_json:
                data_json = data_json.replace(raw, escaped)
    return f"data: {data_json}\n\n"


def json_string(text: str) -> str:
    """`text` as a JSON string literal, escaped exactly as pydantic's model_dump_json
    escapes it (quotes, backslashes, control characters; non-ASCII kept as is)."""
    return msgspec.json.encode(text).decode()


def sse_error(exc: BaseException) -> str:
    """An error as one SSE data line (the stream then ends with [DONE])."""
    return sse(from_exception(exc).to_json())


async def merge_streams(
    iterators: Sequence[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as (iterator index, item), as items arrive.

    Closing the merged iterator (or an error in one of them) cancels and closes all
    of them, which aborts their requests.
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _aclose(iterators[0])
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def drain(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item, None, False))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((index, None, exc, True))
            return
        await queue.put((index, None, None, True))

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error, done = await queue.get()
            if error is not None:
                raise error
            if done:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for iterator in iterators:
            await _aclose(iterator)


async def _aclose(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


async def collect_finals(raw_request: Request, active: ActiveRequest) -> list[RequestOutput]:
    """The last RequestOutput of each prompt of a request that is not streamed, in prompt
    order; finishes `active`.

    Raises ClientDisconnected when the client leaves, or the server's abort error
    (deadline, shutdown).
    """
    async def collect() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(active.streams)
        async with contextlib.aclosing(merge_streams(active.streams)) as merged:
            async for p, output in merged:
                finals[p] = output
        return finals  # type: ignore[return-value]

    try:
        finals = await run_until_disconnect(raw_request, collect())
    finally:
        await active.finish()
    if (error := active.error()) is not None:
        raise error
    return finals


async def collect_final(raw_request: Request, active: ActiveRequest) -> RequestOutput:
    """The last RequestOutput of a one-prompt request (see collect_finals)."""
    return (await collect_finals(raw_request, active))[0]


class ClientDisconnected(Exception):
    pass


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that always ends its request: when the stream completes, when
    the client disconnects (Starlette cancels the send loop, possibly while the body
    generator is parked at a `yield`), or when the response never started. Closing the
    generator and finishing the ActiveRequest aborts whatever is unfinished at once,
    which frees its KV blocks in the core, rather than whenever the garbage collector
    gets to the generator.
    """

    def __init__(self, content: AsyncIterator[str], active: ActiveRequest,
                 media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type)
        self.active = active

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]
            await self.active.finish()


async def run_until_disconnect(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client goes away."""
    handler = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)  # let its aborts run
    if handler.cancelled():
        raise ClientDisconnected()
    return handler.result()
