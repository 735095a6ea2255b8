"""POST /v1/chat/completions: messages through the chat template, n assistant turns out.

Stream shape: per choice a first chunk with `{"role": "assistant", "content": ""}`,
then content deltas, then exactly one chunk with its finish_reason; with
`stream_options.include_usage` a final chunk with no choices and the usage; then [DONE].
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from fastapi import Request

from engine.request_output import RequestOutput, SampleLogprob
from server.apis.contract import Translator, TurnRequest
from server.apis.openai.streaming import StreamChunkWriter, sse_body, usage_chunk_for
from server.chat.output import ChoiceParser, ParsedDelta
from server.chat.run import ChatRun
from server.chat.sampling import (
    json_logprob,
    make_usage,
    record_usage,
)
from server.common.lifecycle import ActiveRequest
from server.common.protocol import (
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
from server.common.state import ServerState
from server.common.streaming import collect_final, json_string


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






class ChatCompletionsTranslator(Translator):
    """POST /v1/chat/completions: the request is already the chat request; n choices,
    each with its own parser and logprobs."""

    body: ChatCompletionRequest

    def chat_request(self) -> TurnRequest:
        return TurnRequest(self.body, id_prefix="chatcmpl")

    async def respond(self, run: ChatRun, raw_request: Request) -> ChatCompletionResponse:
        state, body = self.state, self.body
        final = await collect_final(raw_request, run.active)
        choices = []
        for output in final.outputs:
            parser = ChoiceParser.make(state.reasoning_parser, run.plan)
            choices.append(ChatCompletionChoice(
                index=output.index,
                message=(parser.message(output.text) if parser is not None
                         else ChatResponseMessage(content=output.text)),
                logprobs=(_chat_logprobs(output.logprobs or [], run.num_top) if body.logprobs
                          else None),
                finish_reason=(parser.finish_reason(output.finish_reason)
                               if parser is not None else output.finish_reason),
                stop_reason=output.stop_reason,
            ))
        usage = make_usage([final])
        record_usage(raw_request, usage)
        return ChatCompletionResponse(id=run.request_id, created=run.created,
                                      model=run.model_name, choices=choices, usage=usage)

    def stream(self, run: ChatRun, raw_request: Request) -> AsyncIterator[str]:
        state, body = self.state, self.body
        finals: list[RequestOutput | None] = [None]
        parsers = [ChoiceParser.make(state.reasoning_parser, run.plan) for _ in range(body.n)]
        chunks = _chunks(state, body, run.request_id, run.created, run.active, run.num_top,
                         finals, parsers)
        usage_chunk = usage_chunk_for(body, ChatCompletionStreamResponse, state,
                                      run.request_id, run.created)
        return sse_body(state, raw_request, run.active, chunks, finals, usage_chunk)


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
    writer = ChatChunkWriter(request_id, created, state.response_model(body.model))
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
