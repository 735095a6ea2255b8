"""Reasoning parsers: split a thinking model's output into reasoning and content.

`--reasoning-parser qwen3`: text between `<think>` and `</think>` is the reasoning
(`message.reasoning_content`, `delta.reasoning_content`), the rest is the content
(Qwen3, and the Phi-4 reasoning models, which use the same tags). `mistral`: the same
with Magistral's `[THINK]` and `[/THINK]`, special tokens that its requests keep in the
text (`keeps_special_tokens`).
An output that does not open with `<think>` is all content (Qwen3 with
`enable_thinking: false`: the template already closed an empty think block). A think
block the output never closes (cut by max_tokens) is all reasoning.

Like the tool parsers, a state machine fed the text deltas: `feed(delta) ->
(reasoning, content)`, then `finish()`; the whole text goes through the same machine,
so streamed pieces always add up to the non-streamed message. A piece of text that may
be the start of a tag is held back until it is known not to be one.
"""

from __future__ import annotations

from dataclasses import replace

from engine.structured_output import StructuredOutputsParams

REASONING_PARSERS = ("qwen3", "mistral")
_END_TAGS = {"qwen3": "</think>", "mistral": "[/THINK]"}


def keeps_special_tokens(parser: str | None) -> bool:
    """Whether output read by reasoning parser `parser` must keep special tokens' text."""
    return parser == "mistral"


def grammar_after_reasoning(tokenizer, parser: str, params: StructuredOutputsParams,
                            prompt_token_ids: list[int]) -> StructuredOutputsParams:
    """`params`, applied only once the model has finished thinking.

    When the end tag is one token and the prompt does not hold it already (Qwen3 with
    `enable_thinking: false` closes an empty think block in the prompt), the grammar
    waits for that token: the reasoning before it is free, the answer after it matches.
    """
    end_id = tokenizer.convert_tokens_to_ids(_END_TAGS[parser])
    if not isinstance(end_id, int) or end_id == tokenizer.unk_token_id \
            or end_id in prompt_token_ids:
        return params
    return replace(params, after_token_id=end_id)


class ThinkTagReasoningStream:
    START, END = "<think>", "</think>"

    @classmethod
    def with_tags(cls, start: str, end: str) -> ThinkTagReasoningStream:
        stream = cls()
        stream.START, stream.END = start, end
        return stream

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "start"  # start -> (reasoning ->) content
        self.strip_newlines = False  # drop the newlines that follow a tag

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(self.START):
                self.buffer = head[len(self.START):]
                self.state, self.strip_newlines = "reasoning", True
            elif self.START.startswith(head):
                return "", ""  # empty so far, or maybe the tag arriving
            else:
                self.state = "content"
        if self.state == "reasoning":
            self._strip()
            at = self.buffer.find(self.END)
            if at < 0:
                keep = partial_suffix(self.buffer, self.END)
                reasoning = self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning = self.buffer[:at]
            self.buffer = self.buffer[at + len(self.END):]
            self.state, self.strip_newlines = "content", True
        if self.state == "content":
            self._strip()
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def _strip(self) -> None:
        if self.strip_newlines:
            self.buffer = self.buffer.lstrip("\n")
            self.strip_newlines = not self.buffer

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest

    def parse_all(self, text: str) -> tuple[str, str]:
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content


def make_reasoning_stream(name: str) -> ThinkTagReasoningStream:
    if name == "qwen3":
        return ThinkTagReasoningStream()
    if name == "mistral":
        return ThinkTagReasoningStream.with_tags("[THINK]", "[/THINK]")
    raise ValueError(f"unknown reasoning parser {name!r}; choose from {REASONING_PARSERS}")


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (to hold back: it may be
    the tag, still arriving). Example: partial_suffix("ab</th", "</think>") -> 4."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
