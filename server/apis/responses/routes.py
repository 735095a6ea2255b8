"""The Responses routes: POST /v1/responses, GET and DELETE /v1/responses/{id}."""

from __future__ import annotations

from fastapi import FastAPI, Request

from server.apis.contract import answer, serve_turn, streamed_doc
from server.apis.responses.protocol import DeletedResponse, ResponseObject, ResponsesRequest
from server.apis.responses.store import ResponseStore
from server.apis.responses.translator import ResponsesTranslator
from server.common.errors import ERROR_RESPONSES, APIError
from server.common.state import ServerState


def install_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    """The routes, and the store of responses (sized by --responses-store-size/-ttl)."""
    if state.responses is None:
        state.responses = ResponseStore(state.limits.responses_store_size,
                                        state.limits.responses_store_ttl_s)

    @app.post("/v1/responses", response_model=ResponseObject, dependencies=auth,
              responses=streamed_doc(ERROR_RESPONSES, (
                  "The response. With `stream: true`: `text/event-stream` of the Responses "
                  "events (response.created ... response.completed).")))
    async def responses(body: ResponsesRequest, raw_request: Request):
        return await answer(raw_request,
                            serve_turn(state, ResponsesTranslator(state, body), raw_request))

    def stored(response_id: str):
        item = state.responses.get(response_id)
        if item is None:
            raise APIError(404, f"Response with id '{response_id}' not found (never stored, "
                                "deleted, or expired).", "response_id", "response_not_found")
        return item

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, dependencies=auth,
             responses=ERROR_RESPONSES)
    async def get_response(response_id: str):
        return stored(response_id).response

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse,
                dependencies=auth, responses=ERROR_RESPONSES)
    async def delete_response(response_id: str) -> DeletedResponse:
        stored(response_id)
        state.responses.delete(response_id)
        return DeletedResponse(id=response_id)
