"""The frame of OpenAI's streamed responses (completions and chat chunks): templated chunk
writing, the usage chunk, in-band errors, then `data: [DONE]`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from engine.request_output import RequestOutput
from server.chat.sampling import make_usage, record_usage
from server.common.lifecycle import ActiveRequest
from server.common.protocol import (
    SamplingFields,
    UsageInfo,
)
from server.common.state import ServerState
from server.common.streaming import json_string, sse, sse_error

SSE_DONE = "data: [DONE]\n\n"


class StreamChunkWriter:
    """The SSE events of one streamed response (completion or chat chunks).

    Nearly every chunk is one unfinished choice with a plain delta and no logprobs:
    those are written from a template around the request's fixed fields, byte for
    byte what the pydantic model writes (tests/unit/server/test_server_units.py checks each
    subclass) at a fraction of its cost; any other chunk goes through
    `response_type`. Subclasses set `object_name` and `response_type`.
    """

    object_name: str
    response_type: type

    def __init__(self, request_id: str, created: int, model: str):
        self.request_id, self.created, self.model = request_id, created, model
        self._head = (f'{{"id":{json_string(request_id)},"object":"{self.object_name}",'
                      f'"created":{int(created)},"model":{json_string(model)},'
                      '"choices":[{"index":')

    def _templated(self, index: int, delta_fields: str) -> str:
        """data: {... one choice: `index`, `delta_fields` (JSON members), no logprobs,
        unfinished; no usage}"""
        return sse(f'{self._head}{index},{delta_fields},"logprobs":null,'
                   '"finish_reason":null,"stop_reason":null}],"usage":null}')

    def _response(self, choices: list) -> str:
        return sse(self.response_type(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
        ).model_dump_json())


def usage_chunk_for(body: SamplingFields, response_type: type, state: ServerState,
                    request_id: str, created: int) -> Callable[[UsageInfo], str] | None:
    """The stream's last chunk (`choices: []`, the usage), if `stream_options` asks for it."""
    if body.stream_options is None or not body.stream_options.include_usage:
        return None

    def chunk(usage: UsageInfo) -> str:
        return sse(response_type(id=request_id, created=created, model=state.response_model(body.model),
                                 choices=[], usage=usage).model_dump_json())
    return chunk


async def sse_body(
    state: ServerState,
    raw_request: Request,
    active: ActiveRequest,
    chunks: AsyncIterator[str],
    finals: list[RequestOutput | None],
    usage_chunk: Callable[[UsageInfo], str] | None,
) -> AsyncIterator[str]:
    """The frame every streamed response shares, around the endpoint's own `chunks`.

    After the chunks (which leave each prompt's last RequestOutput in `finals`):
    the usage for the access log, a usage chunk when the client asked for one
    (`usage_chunk`), the error of a server-side abort (deadline, shutdown). Any
    exception becomes an in-band error event. Always ends with [DONE].
    """
    try:
        async with contextlib.aclosing(chunks):
            async for event in chunks:
                yield event
        usage = make_usage(finals)
        record_usage(raw_request, usage)
        if usage_chunk is not None:
            yield usage_chunk(usage)
        if (error := active.error()) is not None:
            raw_request.state.stream_error = True
            yield sse(error.to_json())
    except Exception as exc:  # noqa: BLE001 - the error goes to the client in-band
        raw_request.state.stream_error = True
        state.metrics.record_error(exc)  # e.g. a dead engine (not the engine's own failures)
        yield sse_error(exc)
    yield SSE_DONE
