"""The Anthropic Messages routes: POST /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from fastapi import FastAPI, Request

from server.apis.anthropic.protocol import (
    AnthropicErrorResponse,
    AnthropicMessageResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
)
from server.apis.anthropic.translator import MessagesTranslator, count_tokens
from server.apis.contract import answer, serve_turn, streamed_doc
from server.common.errors import error_docs
from server.common.state import ServerState


def install_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    errors = error_docs(AnthropicErrorResponse)

    @app.post("/v1/messages", response_model=AnthropicMessageResponse, dependencies=auth,
              responses=streamed_doc(errors, (
                  "The message. With `stream: true`: `text/event-stream` of Anthropic's "
                  "events (message_start, content_block_*, message_delta, message_stop).")))
    async def messages(body: MessagesRequest, raw_request: Request):
        return await answer(raw_request,
                            serve_turn(state, MessagesTranslator(state, body), raw_request))

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse,
              dependencies=auth, responses=errors)
    async def messages_count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return count_tokens(state, body)
