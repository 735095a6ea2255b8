"""One assistant turn (n = 1) of a chat run as parsed pieces, for the API layers other
than chat completions (Responses, Anthropic Messages, Ollama): each formats the same
pieces in its own shape.

    ChatRun ──▶ TurnStream.pieces(): a TurnPiece per engine output with something new
                (reasoning, content, tool-call deltas); the last one has the finish reason
            ──▶ collect_turn(): the whole Turn (reasoning, content, calls, finish reason)

server/apis/contract.py's OneTurnTranslator streams or collects through these; `segments`
and `BlockWriter` serve the APIs whose streams open and close blocks (Anthropic content
blocks, Responses output items).

Both go through the same parser (server/chat/output.py), the whole turn fed the whole
text, so a stream adds up to the non-streamed answer. A turn the server aborted
(deadline, shutdown) raises its error instead of finishing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from fastapi import Request

from engine.request_output import RequestOutput
from server.chat.output import ParsedDelta
from server.chat.run import ChatRun
from server.chat.sampling import make_usage, record_usage
from server.chat.tool_parsers import ToolCall, ToolCallDelta, merge_deltas
from server.common.protocol import UsageInfo
from server.common.state import ServerState
from server.common.streaming import collect_final


@dataclass
class TurnPiece:
    delta: ParsedDelta
    # On the last piece: "stop" | "length" | "tool_calls" (auto/required calls made).
    finish_reason: str | None
    stop_reason: int | str | None  # the stop string or token id that ended the turn


@dataclass
class Turn:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str
    stop_reason: int | str | None
    output: RequestOutput

    @property
    def usage(self) -> UsageInfo:
        return make_usage([self.output])


class TurnStream:
    """The pieces of one streamed turn; `final` is its latest RequestOutput (usage)."""

    def __init__(self, state: ServerState, run: ChatRun):
        self.run = run
        self.parser = run.parser(state)
        self.final: RequestOutput | None = None

    async def pieces(self) -> AsyncIterator[TurnPiece]:
        async for request_output in self.run.active.streams[0]:
            self.final = request_output
            output = request_output.outputs[0]
            delta = self.parser.feed(output.delta_text) if output.delta_text else ParsedDelta()
            if not output.finished:
                if delta:
                    yield TurnPiece(delta, None, None)
                continue
            if (error := self.run.active.error()) is not None:
                raise error
            last = self.parser.finish()
            yield TurnPiece(
                ParsedDelta(delta.reasoning + last.reasoning, delta.content + last.content,
                            delta.tool_calls + last.tool_calls),
                self.parser.finish_reason(output.finish_reason), output.stop_reason)
            return

    @property
    def usage(self) -> UsageInfo:
        return make_usage([self.final])


async def collect_turn(state: ServerState, run: ChatRun, raw_request: Request) -> Turn:
    """The whole turn of a request that is not streamed (finishes the run)."""
    final = await collect_final(raw_request, run.active)
    output = final.outputs[0]
    parser = run.parser(state)
    first, last = parser.feed(output.text), parser.finish()
    turn = Turn(first.reasoning + last.reasoning, first.content + last.content,
                merge_deltas(first.tool_calls + last.tool_calls),
                parser.finish_reason(output.finish_reason), output.stop_reason, final)
    record_usage(raw_request, turn.usage)
    return turn


@dataclass
class Segment:
    """One run of a turn's output, in output order: reasoning, text, or a tool call's
    argument text (`call` carries the call's index, and its id and name on its first)."""

    kind: str  # "reasoning" | "text" | "tool"
    text: str
    call: ToolCallDelta | None = None


def segments(delta: ParsedDelta) -> list[Segment]:
    """The segments of one piece, a tool call's fragments joined.

    Example: ParsedDelta("hm", "Hi", [call 0 id=c name=f "{", call 0 "}"]) ->
    [Segment("reasoning", "hm"), Segment("text", "Hi"), Segment("tool", "{}", call 0 id=c)]
    """
    result = []
    if delta.reasoning:
        result.append(Segment("reasoning", delta.reasoning))
    if delta.content:
        result.append(Segment("text", delta.content))
    for call in delta.tool_calls:
        last = result[-1] if result else None
        if last is not None and last.call is not None and last.call.index == call.index \
                and call.id is None:
            last.text += call.arguments
        else:
            result.append(Segment("tool", call.arguments, call))
    return result


class BlockWriter:
    """Streams segments as blocks (Anthropic content blocks, Responses output items):
    a segment of a new kind (or another call) closes the open block and opens the
    next. Subclasses write the events of `open`, `delta` and `close`; `index` is the
    open block's position in the turn."""

    def __init__(self) -> None:
        self.key: tuple[str, int | None] | None = None
        self.index = -1

    def write(self, segment: Segment) -> Iterator[str]:
        key = (segment.kind, segment.call.index if segment.call is not None else None)
        if key != self.key:
            yield from self.end()
            self.key = key
            self.index += 1
            yield from self.open(segment)
        if segment.text:
            yield from self.delta(segment)

    def write_delta(self, delta: ParsedDelta) -> Iterator[str]:
        """The events of one piece: each of its segments written in order."""
        for segment in segments(delta):
            yield from self.write(segment)

    def end(self) -> Iterator[str]:
        """Close the open block, if any."""
        if self.key is not None:
            yield from self.close()
            self.key = None

    def open(self, segment: Segment) -> Iterator[str]:
        raise NotImplementedError

    def delta(self, segment: Segment) -> Iterator[str]:
        raise NotImplementedError

    def close(self) -> Iterator[str]:
        raise NotImplementedError
