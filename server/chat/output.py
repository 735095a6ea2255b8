"""One chat choice's generated text -> reasoning, content and tool calls.

    text deltas -> reasoning parser (--reasoning-parser) -> reasoning | content
                                              content -> tool parser (ToolPlan) -> content | calls

`feed` takes each new piece of text and returns what can be sent now; `finish`
flushes what was held back (a possible tag, a tool call still open). The whole
(non-streamed) message is the same machine fed the whole text, so a stream always
adds up to the non-streamed message.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from server.chat.reasoning import make_reasoning_stream
from server.chat.tool_parsers import ToolCallDelta, merge_deltas
from server.chat.tools import ToolPlan
from server.common.protocol import (
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ResponseToolCall,
)


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def to_delta(self) -> DeltaMessage:
        merged: list[ToolCallDelta] = []
        for c in self.tool_calls:  # one entry per call and chunk: fragments joined
            if merged and merged[-1].index == c.index and c.id is None:
                merged[-1] = replace(merged[-1], arguments=merged[-1].arguments + c.arguments)
            else:
                merged.append(c)
        calls = [DeltaToolCall(index=c.index, id=c.id,
                               type="function" if c.id is not None else None,
                               function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                 for c in merged]
        return DeltaMessage(content=self.content or None,
                            reasoning_content=self.reasoning or None, tool_calls=calls or None)


class ChoiceParser:
    """Parses one choice; `None` from `make` when the choice is plain text."""

    def __init__(self, reasoning_parser: str | None, plan: ToolPlan):
        self.reasoning = make_reasoning_stream(reasoning_parser) if reasoning_parser else None
        self.tools = plan.make_stream()
        self.mode = plan.mode

    @classmethod
    def make(cls, reasoning_parser: str | None, plan: ToolPlan) -> ChoiceParser | None:
        if reasoning_parser is None and plan.mode == "none":
            return None
        return cls(reasoning_parser, plan)

    def feed(self, text: str) -> ParsedDelta:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._tools(reasoning, content, final=False)

    def finish(self) -> ParsedDelta:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._tools(reasoning, content, final=True)

    def _tools(self, reasoning: str, content: str, final: bool) -> ParsedDelta:
        if self.tools is None:
            return ParsedDelta(reasoning, content)
        content, calls = self.tools.feed(content) if content else ("", [])
        if final:
            more_content, more_calls = self.tools.finish()
            content, calls = content + more_content, calls + more_calls
        return ParsedDelta(reasoning, content, calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" when auto/required made calls and generation ended normally."""
        if reason == "stop" and self.mode in ("auto", "required") and self.tools.num_calls:
            return "tool_calls"
        return reason

    def message(self, text: str) -> ChatResponseMessage:
        """The whole message of a finished choice whose text is `text`."""
        first, last = self.feed(text), self.finish()
        calls = merge_deltas(first.tool_calls + last.tool_calls)
        content = first.content + last.content
        reasoning = first.reasoning + last.reasoning
        return ChatResponseMessage(
            content=content if content or not calls else None,
            reasoning_content=reasoning or None,
            tool_calls=[ResponseToolCall(id=c.id, function=FunctionCall(
                name=c.name, arguments=c.arguments)) for c in calls] or None)
