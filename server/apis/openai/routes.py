"""The OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions, their /render
(render.py), /tokenize and /detokenize (the Responses API is server/apis/responses/)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from server.apis.contract import answer, serve_turn
from server.apis.openai.chat import ChatCompletionsTranslator
from server.apis.openai.completions import create_completion
from server.apis.openai.render import install_render_routes
from server.chat.sampling import check_model
from server.chat.template import apply_chat_template
from server.common.errors import ERROR_RESPONSES, APIError
from server.common.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from server.common.state import ServerState


def _stream_doc(model: type, what: str) -> dict:
    # Before OpenAPI 3.2 (itemSchema), `schema` of `text/event-stream` describes one event:
    # its `data` is a JSON chunk, an error object (a failed stream), or the final [DONE].
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": {
                "anyOf": [{"$ref": f"#/components/schemas/{model.__name__}"},
                          {"$ref": "#/components/schemas/ErrorResponse"}]}},
        ]}},
    }
    return {
        200: {
            "description": (
                f"The {what}. With `stream: true`: `text/event-stream`, one "
                f"`data: <{model.__name__}>` event per chunk (or an ErrorResponse if the "
                f"request fails midway), then `data: [DONE]`."),
            "content": {"text/event-stream": {"schema": event}},
        },
        **ERROR_RESPONSES,
    }


def install_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    @app.get("/v1/models", response_model=ModelList, dependencies=auth,
             responses={401: ERROR_RESPONSES[401]})
    async def list_models() -> ModelList:
        return ModelList(data=[
            ModelCard(id=name, created=state.created, root=state.model_root,
                      max_model_len=state.max_model_len,
                      sampling_defaults=state.sampling_defaults.fields,
                      chat_template=state.chat_template_source)
            for name in state.served_model_names
        ] + [
            ModelCard(id=adapter.name, created=state.created, root=adapter.path,
                      parent=state.model_name, max_model_len=state.max_model_len,
                      sampling_defaults=state.sampling_defaults.fields,
                      chat_template=state.chat_template_source)
            for adapter in (state.lora or [])
        ])

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=auth,
              responses=_stream_doc(CompletionStreamResponse, "completion"))
    async def completions(body: CompletionRequest, raw_request: Request):
        return await answer(raw_request, create_completion(state, body, raw_request))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              dependencies=auth, responses=_stream_doc(ChatCompletionStreamResponse,
                                                       "chat completion"))
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        return await answer(raw_request, serve_turn(
            state, ChatCompletionsTranslator(state, body), raw_request))

    install_render_routes(app, state, auth)

    @app.post("/tokenize", response_model=TokenizeResponse, dependencies=auth,
              responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of `prompt`, or of `messages` rendered with the chat template."""
        check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of 'prompt' and 'messages'.", "prompt",
                           "invalid_value")
        if body.messages is not None:
            _, tokens = apply_chat_template(state, body.messages, body.add_generation_prompt,
                                            continue_final_message=body.continue_final_message)
        else:
            tokens = list(state.tokenizer(body.prompt,
                                          add_special_tokens=body.add_special_tokens).input_ids)
        return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len,
                                tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=auth,
              responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(state, body.model)
        vocab_size = state.engine.vocab_size
        for token_id in body.tokens:
            if not 0 <= token_id < vocab_size:
                raise APIError(400, f"Token id {token_id} is out of vocabulary (valid ids are "
                                    f"0..{vocab_size - 1}).", "tokens", "invalid_value")
        return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))
