"""POST /v1/chat/completions: messages through the chat template, one assistant turn out.

Stream shape: per choice a first chunk with `{"role": "assistant", "content": ""}`,
then content deltas, then exactly one chunk with its finish_reason; with
`stream_options.include_usage` a final chunk with no choices and the usage; then [DONE].
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request

from engine.request_output import RequestOutput, SampleLogprob
from server.chat_output import ChoiceParser, ParsedDelta
from server.errors import bad_request
from server.lifecycle import ActiveRequest
from server.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
)
from server.reasoning import grammar_after_reasoning
from server.reasoning import keeps_special_tokens as reasoning_keeps_special_tokens
from server.serving_common import (
    EngineStreamingResponse,
    StreamChunkWriter,
    apply_chat_template,
    build_sampling_params,
    check_common,
    check_prompts,
    check_template_kwargs,
    collect_final,
    json_logprob,
    json_string,
    make_usage,
    new_request_id,
    record_usage,
    record_user,
    sse_body,
    usage_chunk_for,
)
from server.state import ServerState
from server.tool_parsers import keeps_special_tokens as tool_parser_keeps_special_tokens
from server.tools import ToolPlan, plan_output


def _chat_logprobs(entries: Sequence[SampleLogprob], num_top: int) -> ChatChoiceLogProbs:
    content = []
    for entry in entries:
        top = [
            ChatTopLogprob(token=t.token, logprob=json_logprob(t.logprob),
                           bytes=list(t.token.encode("utf-8")))
            for t in entry.top[:num_top]
        ]
        content.append(ChatTokenLogprob(
            token=entry.token, logprob=json_logprob(entry.logprob),
            bytes=list(entry.token.encode("utf-8")), top_logprobs=top))
    return ChatChoiceLogProbs(content=content)


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

    def parser(self, state: ServerState) -> ChoiceParser:
        """A fresh parser of one choice (reasoning, tool calls; plain text passes through)."""
        return ChoiceParser(state.reasoning_parser, self.plan)


async def start_chat(state: ServerState, body: ChatCompletionRequest, raw_request: Request,
                     id_prefix: str = "chatcmpl", prompt_token_ids: list[int] | None = None,
                     max_context: int | None = None) -> ChatRun:
    """Check `body`, render its messages through the chat template, start the generation.

    Every API that produces one assistant turn goes through here (chat completions, and
    the Responses, Anthropic and Ollama layers, which translate their requests into a
    ChatCompletionRequest). `prompt_token_ids`: a prompt to use instead of the rendered
    messages (Ollama's raw generate). `max_context`: a client-side context limit below
    the server's (Ollama's num_ctx): the prompt must fit it and the output stops at it.
    Errors are 400 APIErrors naming chat's field names.
    """
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
                                       structured_outputs=structured_outputs)
    except Exception as exc:
        if getattr(exc, "param", None) == "logprobs":
            exc.param = "top_logprobs"  # chat's name for the number of alternatives
        raise
    if (plan.mode == "auto" and tool_parser_keeps_special_tokens(plan.parser)) or \
            reasoning_keeps_special_tokens(state.reasoning_parser):
        params.skip_special_tokens = False  # the format's markers are special tokens
    if prompt_token_ids is None:
        _, prompt_token_ids = apply_chat_template(state, body.messages,
                                                  body.add_generation_prompt,
                                                  plan.template_tools, template_kwargs)
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
    state.metrics.record_structured_output(structured_outputs)

    request_id = new_request_id(id_prefix)
    active = await state.lifecycle.start([(request_id, prompt_token_ids, None)], params,
                                         priority=body.priority, cache_salt=body.cache_salt)
    return ChatRun(request_id, int(time.time()), active, plan, num_top, len(prompt_token_ids))


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest,
                                 raw_request: Request):
    run = await start_chat(state, body, raw_request)
    request_id, created, active, plan, num_top = (run.request_id, run.created, run.active,
                                                  run.plan, run.num_top)
    if body.stream:
        finals: list[RequestOutput | None] = [None]
        parsers = [ChoiceParser.make(state.reasoning_parser, plan) for _ in range(body.n)]
        chunks = _chunks(state, body, request_id, created, active, num_top, finals, parsers)
        usage_chunk = usage_chunk_for(body, ChatCompletionStreamResponse, state, request_id, created)
        return EngineStreamingResponse(
            sse_body(state, raw_request, active, chunks, finals, usage_chunk), active)

    final = await collect_final(raw_request, active)
    choices = []
    for output in final.outputs:
        parser = ChoiceParser.make(state.reasoning_parser, plan)
        choices.append(ChatCompletionChoice(
            index=output.index,
            message=(parser.message(output.text) if parser is not None
                     else ChatResponseMessage(content=output.text)),
            logprobs=_chat_logprobs(output.logprobs or [], num_top) if body.logprobs else None,
            finish_reason=(parser.finish_reason(output.finish_reason) if parser is not None
                           else output.finish_reason),
            stop_reason=output.stop_reason,
        ))
    usage = make_usage([final])
    record_usage(raw_request, usage)
    return ChatCompletionResponse(id=request_id, created=created, model=state.model_name,
                                  choices=choices, usage=usage)


class ChatChunkWriter(StreamChunkWriter):
    """The SSE events of one streamed chat completion (see StreamChunkWriter)."""

    object_name = "chat.completion.chunk"
    response_type = ChatCompletionStreamResponse

    def content(self, index: int, text: str) -> str:
        """data: {... one choice: `index`, delta {"content": `text`}, unfinished ...}"""
        return self._templated(index, f'"delta":{{"content":{json_string(text)}}}')

    def choices(self, choices: list[ChatCompletionStreamChoice]) -> str:
        return self._response(choices)


async def _chunks(
    state: ServerState,
    body: ChatCompletionRequest,
    request_id: str,
    created: int,
    active: ActiveRequest,
    num_top: int,
    finals: list[RequestOutput | None],
    parsers: list[ChoiceParser | None],
) -> AsyncIterator[str]:
    """The chat chunks of a stream; `sse_body` adds usage, errors and [DONE].

    A choice with a parser (tools, reasoning) sends what its parser lets out: text it
    holds back (a possible tag, an open tool call) comes with a later chunk.
    """
    writer = ChatChunkWriter(request_id, created, state.model_name)
    chunk = writer.choices

    finish_sent = [False] * body.n
    for index in range(body.n):
        yield chunk([ChatCompletionStreamChoice(
            index=index, delta=DeltaMessage(role="assistant", content=""))])
    async for request_output in active.streams[0]:
        finals[0] = request_output
        for output in request_output.outputs:
            if finish_sent[output.index]:
                continue
            logprobs = None
            if body.logprobs and output.delta_logprobs:
                logprobs = _chat_logprobs(output.delta_logprobs, num_top)
            finished = output.finished
            parser = parsers[output.index]
            finish_reason = output.finish_reason if finished else None
            if parser is None:
                if not output.delta_text and not finished and logprobs is None:
                    continue
                if not finished and logprobs is None:
                    yield writer.content(output.index, output.delta_text)
                    continue
                delta = DeltaMessage(content=output.delta_text)
            else:
                parsed = parser.feed(output.delta_text)
                if finished:
                    last = parser.finish()
                    parsed = ParsedDelta(parsed.reasoning + last.reasoning,
                                         parsed.content + last.content,
                                         parsed.tool_calls + last.tool_calls)
                    finish_reason = parser.finish_reason(finish_reason)
                if not parsed and not finished and logprobs is None:
                    continue
                delta = parsed.to_delta()
            finish_sent[output.index] = finished
            yield chunk([ChatCompletionStreamChoice(
                index=output.index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=output.stop_reason if finished else None,
            )])
