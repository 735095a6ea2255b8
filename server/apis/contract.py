"""The one contract every HTTP API implements, and `serve_turn`, which runs it for all.

    API request ─▶ Translator(state, body) ─▶ .chat_request(): a TurnRequest (the
                   engine-facing chat request: a ChatCompletionRequest, plus the prompt
                   tokens or context limit a few APIs set themselves)
                ─▶ start_chat() (server/chat/run.py): checked, templated, admitted, queued
                ─▶ stream?  .stream(run): the body's chunks, in .media_type
                   else     .respond(run): the API's response object
    errors: an APIError anywhere becomes the API's own error shape (server/common/errors.py
    picks it by path); in a stream, the translator's in-band error event.

APIs that answer with one assistant turn (Responses, Anthropic, Ollama) extend
`OneTurnTranslator` and write three things: `response(run, turn)` (the whole answer),
`events(run, stream)` (their stream events from parsed pieces) and `error_event(error)`.
OpenAI chat completions (n choices, per-token logprobs) implements `Translator` itself.

To add an API: write its pydantic models (server/apis/<name>/protocol.py), a Translator
(server/apis/<name>/translator.py) using server/chat/translate.py's shared pieces, and
`install_routes(app, state, auth)` (server/apis/<name>/routes.py) whose handlers return
`answer(raw_request, serve_turn(state, Translator(state, body), raw_request))`; then list
its paths in server/common/api_label.py and call install_routes from server/http/app.py.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.frontend.async_engine import EngineRequestError
from server.chat.run import ChatRun, start_chat
from server.chat.sampling import record_usage
from server.chat.turn import Turn, TurnStream, collect_turn
from server.common.errors import APIError, from_exception
from server.common.protocol import ChatCompletionRequest
from server.common.state import ServerState
from server.common.streaming import ClientDisconnected, EngineStreamingResponse

SSE = "text/event-stream"


@dataclass
class TurnRequest:
    """What a translator asks of the chat path."""

    chat: ChatCompletionRequest
    id_prefix: str  # of the request id: the API's label (server/common/api_label.py)
    prompt_token_ids: list[int] | None = None  # instead of the rendered messages
    max_context: int | None = None  # a client's context limit below the server's
    # The API's own documented defaults of unset sampling fields, under the server's
    # (engine/sampling_defaults.py; Ollama: temperature 0.8, top_k 40, top_p 0.9).
    api_defaults: dict[str, Any] | None = None


class Translator(ABC):
    """One request of one API, from its body to its answer (see the module doc)."""

    media_type: str = SSE

    def __init__(self, state: ServerState, body: Any):
        self.state, self.body = state, body

    @abstractmethod
    def chat_request(self) -> TurnRequest:
        """The request on the chat path; a 400 APIError (in the API's field names) if bad."""

    @abstractmethod
    async def respond(self, run: ChatRun, raw_request: Request) -> Any:
        """The whole answer of a request that is not streamed (finishes `run`)."""

    @abstractmethod
    def stream(self, run: ChatRun, raw_request: Request) -> AsyncIterator[str]:
        """The streamed body, chunk by chunk; a failure midway is written in-band."""


class OneTurnTranslator(Translator):
    """An API whose answer is one assistant turn (n = 1) as parsed pieces."""

    @abstractmethod
    def response(self, run: ChatRun, turn: Turn) -> Any:
        """The answer of a whole turn."""

    @abstractmethod
    def events(self, run: ChatRun, stream: TurnStream) -> AsyncIterator[str]:
        """The stream's events, from `stream.pieces()`."""

    @abstractmethod
    def error_event(self, error: APIError) -> str:
        """A failure midway, as the API writes it in a stream."""

    async def respond(self, run: ChatRun, raw_request: Request) -> Any:
        return self.response(run, await collect_turn(self.state, run, raw_request))

    async def stream(self, run: ChatRun, raw_request: Request) -> AsyncIterator[str]:
        stream = TurnStream(self.state, run)
        try:
            async with contextlib.aclosing(self.events(run, stream)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except Exception as exc:  # noqa: BLE001 - the error goes to the client in-band
            raw_request.state.stream_error = True
            if not isinstance(exc, APIError):
                self.state.metrics.record_error(exc)  # e.g. a dead engine
            yield self.error_event(from_exception(exc))
        if stream.final is not None:
            record_usage(raw_request, stream.usage)


async def serve_turn(state: ServerState, translator: Translator, raw_request: Request):
    """Start the translator's chat request; stream its body or collect its answer."""
    request = translator.chat_request()
    run = await start_chat(state, request.chat, raw_request, id_prefix=request.id_prefix,
                           prompt_token_ids=request.prompt_token_ids,
                           max_context=request.max_context,
                           api_defaults=request.api_defaults)
    if request.chat.stream:
        return EngineStreamingResponse(translator.stream(run, raw_request), run.active,
                                       translator.media_type)
    try:
        return await translator.respond(run, raw_request)
    finally:
        await run.active.finish()  # a no-op when respond collected it; else frees its KV


def streamed_doc(errors: dict, description: str, media_type: str = SSE) -> dict:
    """A generation route's OpenAPI `responses`: its errors, and a 200 that may stream."""
    return {**errors, 200: {"description": description, "content": {media_type: {}}}}


async def answer(raw_request: Request, work: Awaitable[Any]) -> Any:
    """Await a generation route's work, mapping what it raises.

    A client that left gets 499; a request the engine failed gets its error object
    without counting as an HTTP failure (the engine counted it); anything else becomes
    an APIError (the API's error shape, by path).
    """
    try:
        return await work
    except ClientDisconnected:
        return Response(status_code=499)
    except EngineRequestError as exc:  # counted by the engine, not as an HTTP failure
        return from_exception(exc).to_response(raw_request.url.path)
    except Exception as exc:
        raise from_exception(exc) from exc
