"""Start one chat generation: check the chat request, render it through the chat template,
build its SamplingParams and queue it. Every API that answers with an assistant turn
(chat completions, Responses, Anthropic Messages, Ollama) starts here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from engine.multimodal.inputs import ImageFeature
from engine.sampling_params import SamplingParams
from server.chat.images import load_chat_images
from server.chat.output import ChoiceParser
from server.chat.reasoning import grammar_after_reasoning
from server.chat.reasoning import keeps_special_tokens as reasoning_keeps_special_tokens
from server.chat.sampling import (
    build_sampling_params,
    check_common,
    check_prompts,
    new_request_id,
    record_user,
)
from server.chat.template import apply_chat_template, check_template_kwargs
from server.chat.tool_parsers import keeps_special_tokens as tool_parser_keeps_special_tokens
from server.chat.tools import ToolPlan, plan_output
from server.common.errors import bad_request
from server.common.lifecycle import ActiveRequest
from server.common.protocol import ChatCompletionRequest
from server.common.state import ServerState


@dataclass
class ChatRun:
    """A chat generation the engine has (admitted and queued): what formatters need.

    The caller owns `active` and must `finish()` it (EngineStreamingResponse does).
    """

    request_id: str
    created: int
    active: ActiveRequest
    plan: ToolPlan
    num_top: int  # top logprobs per token (0: none)
    num_prompt_tokens: int
    model_name: str  # what the response's `model` says (ServerState.response_model)

    def parser(self, state: ServerState) -> ChoiceParser:
        """A fresh parser of one choice (reasoning, tool calls; plain text passes through)."""
        return ChoiceParser(state.reasoning_parser, self.plan)


@dataclass
class PreparedChat:
    """A checked chat request rendered to what the engine takes (not yet queued)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    mm_features: list[ImageFeature] | None
    plan: ToolPlan
    num_top: int  # top logprobs per token (0: none)
    num_images: int
    structured_outputs: Any  # the request's grammar (StructuredOutputsParams) or None


async def prepare_chat(state: ServerState, body: ChatCompletionRequest, raw_request: Request,
                       prompt_token_ids: list[int] | None = None,
                       max_context: int | None = None,
                       api_defaults: Mapping[str, Any] | None = None) -> PreparedChat:
    """Check `body`, render its messages through the chat template (images expanded),
    build its SamplingParams: everything `start_chat` queues, and what
    /v1/chat/completions/render answers. Arguments and errors as `start_chat`'s."""
    check_common(state, body, body.unsupported_field())
    record_user(raw_request, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs",
                          "invalid_value")
    num_top = body.top_logprobs or 0
    plan, structured_outputs = await plan_output(body, state.tool_call_parser, state.engine)
    template_kwargs = check_template_kwargs(body.chat_template_kwargs)
    try:
        params = build_sampling_params(state, body, logprobs=num_top if body.logprobs else None,
                                       structured_outputs=structured_outputs,
                                       api_defaults=api_defaults)
    except Exception as exc:
        if getattr(exc, "param", None) == "logprobs":
            exc.param = "top_logprobs"  # chat's name for the number of alternatives
        raise
    if (plan.mode == "auto" and tool_parser_keeps_special_tokens(plan.parser)) or \
            reasoning_keeps_special_tokens(state.reasoning_parser):
        params.skip_special_tokens = False  # the format's markers are special tokens
    mm_features = None
    images = await load_chat_images(body.messages, state.limits, state.model_name,
                                    state.image_processor is not None)
    if images and prompt_token_ids is None:
        processor = state.image_processor
        text, _ = apply_chat_template(state, body.messages, body.add_generation_prompt,
                                      plan.template_tools, template_kwargs,
                                      body.continue_final_message, processor.placeholder)
        try:
            processed = await asyncio.to_thread(processor.process, text, images)
        except ValueError as exc:  # the template dropped or repeated an image
            raise bad_request(f"The chat template did not place the images: {exc}",
                              "messages") from None
        prompt_token_ids, mm_features = processed.token_ids, processed.features
    elif prompt_token_ids is None:
        _, prompt_token_ids = apply_chat_template(state, body.messages,
                                                  body.add_generation_prompt,
                                                  plan.template_tools, template_kwargs,
                                                  body.continue_final_message)
    if max_context is not None:
        room = max_context - len(prompt_token_ids)
        if room < 1:
            raise bad_request(f"The prompt has {len(prompt_token_ids)} tokens, which leaves "
                              f"no room in the context of {max_context}.", "num_ctx",
                              "invalid_value")
        params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    if structured_outputs is not None and state.reasoning_parser is not None:
        params.structured_outputs = grammar_after_reasoning(
            state.tokenizer, state.reasoning_parser, structured_outputs, prompt_token_ids)
    check_prompts(state, [prompt_token_ids], params, body, prompt_param="messages")
    return PreparedChat(params, prompt_token_ids, mm_features, plan, num_top, len(mm_features or []),
                        structured_outputs)


async def start_chat(state: ServerState, body: ChatCompletionRequest, raw_request: Request,
                     id_prefix: str = "chatcmpl", prompt_token_ids: list[int] | None = None,
                     max_context: int | None = None,
                     api_defaults: Mapping[str, Any] | None = None) -> ChatRun:
    """Check `body`, render its messages through the chat template, start the generation.

    Every API that produces one assistant turn goes through here (chat completions, and
    the Responses, Anthropic and Ollama layers, which translate their requests into a
    ChatCompletionRequest). `prompt_token_ids`: a prompt to use instead of the rendered
    messages (Ollama's raw generate). `max_context`: a client-side context limit below
    the server's (Ollama's num_ctx): the prompt must fit it and the output stops at it.
    `api_defaults`: the API's own defaults of unset sampling fields (build_sampling_params).
    Errors are 400 APIErrors naming chat's field names.
    """
    chat = await prepare_chat(state, body, raw_request, prompt_token_ids, max_context,
                              api_defaults)
    if chat.num_images:
        state.metrics.record_images(chat.num_images)
    state.metrics.record_structured_output(chat.structured_outputs)
    request_id = new_request_id(id_prefix)
    active = await state.lifecycle.start([(request_id, chat.prompt_token_ids, None)],
                                         chat.params, priority=body.priority,
                                         cache_salt=body.cache_salt,
                                         lora_request=state.lora_request(body.model),
                                         mm_features=chat.mm_features)
    return ChatRun(request_id, int(time.time()), active, chat.plan, chat.num_top,
                   len(chat.prompt_token_ids), state.response_model(body.model))
