"""Tool calls out of generated text, streamed or whole: one parser per output format.

Every parser is a small state machine fed the output's text deltas in order:
`feed(delta) -> (content, [ToolCallDelta])` and, at the end, `finish()`. A whole
(non-streamed) output goes through the same machine (`parse_all`), so the streamed
fragments always add up to the non-streamed message.

    NamedToolStream     tool_choice {"function": {"name"}}: the grammar makes the whole
                        output the arguments object; fragments pass straight through
    RequiredToolStream  tool_choice "required": the grammar makes the output
                        [{"name": "f", "parameters": {...}}, ...] in a fixed layout
    HermesToolStream    "auto", Qwen2/Qwen3 (--tool-call-parser hermes): content, then
                        <tool_call>{"name": "f", "arguments": {...}}</tool_call> blocks
    Llama3JsonToolStream  "auto", Llama 3 (llama3_json): the output is
                        {"name": "f", "parameters": {...}} (several joined by ';'),
                        optionally after <|python_tag|>; anything else is content
    MistralToolStream   "auto", Mistral (mistral): content, then [TOOL_CALLS] and a JSON
                        array [{"name": "f", "arguments": {...}}, ...], or (tokenizers
                        v11+) [TOOL_CALLS]f[ARGS]{...} per call; ids of 9 alphanumerics
    Phi4MiniJsonToolStream  "auto", Phi-4-mini (phi4_mini_json): content, then
                        <|tool_call|>[{"name": "f", "arguments": {...}}]<|/tool_call|>,
                        or functools[...] (vLLM's template for it)
    PythonicToolStream  "auto", Gemma 3 (pythonic): the output is a Python list of calls,
                        [f(a=1, b="x"), g()], optionally in a ```tool_code fence

The Mistral and Phi-4-mini markers are special tokens of their tokenizers: a request parsed
by them is detokenized with `skip_special_tokens` off (`keeps_special_tokens`), as vLLM does.

Arguments are always JSON text as the model wrote it (OpenAI's `arguments` string).
A call's first delta carries its `id` and `name`; later ones only argument fragments.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass

from server.chat.pythonic_calls import parse_pythonic_calls
from server.chat.reasoning import partial_suffix

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "phi4_mini_json", "pythonic")
# Parser used for "auto" by model family (config.json model_type). Phi-3 and Phi-3.5 have
# no tool format; Phi-4-mini (model_type phi3 too) has phi4_mini_json's.
_FAMILY_PARSERS = {"qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                   "qwen2_moe": "hermes", "llama": "llama3_json", "mistral": "mistral",
                   "phi3": "phi4_mini_json", "gemma3": "pythonic", "gemma3_text": "pythonic"}
# Parsers whose markers are special tokens (dropped by skip_special_tokens).
_SPECIAL_TOKEN_PARSERS = ("mistral", "phi4_mini_json")


def parser_for_model_type(model_type: str | None) -> str | None:
    return _FAMILY_PARSERS.get(model_type or "")


def keeps_special_tokens(parser: str | None) -> bool:
    """Whether output parsed by `parser` must keep its special tokens' text."""
    return parser in _SPECIAL_TOKEN_PARSERS


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_mistral_tool_call_id() -> str:
    """Mistral's chat templates refuse a call id that is not 9 letters or digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    """A whole call, reassembled from its deltas."""

    id: str
    name: str
    arguments: str = ""


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Reassemble calls the way the OpenAI SDK does: by index, arguments appended."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        call = calls.setdefault(delta.index, ToolCall(id=delta.id or "", name=delta.name or ""))
        call.arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


class ToolStream:
    """Base: `feed` and `finish` return (content text, tool call deltas)."""

    num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []

    def parse_all(self, text: str) -> tuple[str, list[ToolCall]]:
        content, deltas = self.feed(text)
        tail, more = self.finish()
        return content + tail, merge_deltas(deltas + more)


class NamedToolStream(ToolStream):
    """The whole output is the arguments of the one named function."""

    def __init__(self, name: str):
        self.name = name

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.num_calls == 0:
            self.num_calls = 1
            return "", [ToolCallDelta(0, new_tool_call_id(), self.name, text)]
        return "", [ToolCallDelta(0, arguments=text)] if text else []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.feed("") if self.num_calls == 0 else ("", [])


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at `text[start]`; None while incomplete.

    Example: json_value_end('{"a": [1, "}"]}, x', 0) -> 15
    """
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        i = start + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    if first not in "[{":
        match = re.compile(r"[^,}\]\s]*").match(text, start)
        end = match.end()
        return end if end < len(text) else None  # a number may still grow
    depth, i, in_string = 0, start, False
    while i < len(text):
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


_REQUIRED_CALL = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                            r'"parameters"\s*:\s*(?=[\[{"0-9tfn-])')


class RequiredToolStream(ToolStream):
    """Output constrained to [{"name": ..., "parameters": {...}}, ...]: stream each call's
    name once, then its parameters' text as it grows."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # where the next call's header may start
        self.args_start: int | None = None  # the current call's parameters start here
        self.sent = 0  # characters of the current call's parameters already sent

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += text
        deltas: list[ToolCallDelta] = []
        while True:
            if self.args_start is None:
                match = _REQUIRED_CALL.match(self.text, self.pos)
                if match is None:
                    return "", deltas
                self.args_start = match.end()
                self.sent = 0
                deltas.append(ToolCallDelta(self.num_calls, new_tool_call_id(),
                                            json.loads(f'"{match.group(1)}"')))
                self.num_calls += 1
            end = json_value_end(self.text, self.args_start)
            stop = end if end is not None else len(self.text)
            fragment = self.text[self.args_start + self.sent:stop]
            if fragment:
                self.sent += len(fragment)
                deltas.append(ToolCallDelta(self.num_calls - 1, arguments=fragment))
            if end is None:
                return "", deltas
            close = self.text.find("}", end)  # the call object's own closing brace
            if close < 0:
                return "", deltas  # next time: same end, nothing new to send
            self.pos, self.args_start = close + 1, None


class HermesToolStream(ToolStream):
    """Content, then <tool_call> JSON </tool_call> blocks (Qwen2/Qwen3 templates)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.buffer = ""
        self.in_calls = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        if not self.in_calls:
            at = self.buffer.find(self.START)
            if at < 0:
                keep = partial_suffix(self.buffer, self.START)
                content, self.buffer = self.buffer[:len(self.buffer) - keep], \
                    self.buffer[len(self.buffer) - keep:]
                return content, []
            content, self.buffer = self.buffer[:at], self.buffer[at:]
            self.in_calls = True
            _, deltas = self._calls(final=False)
            return content, deltas
        return "", self._calls(final=False)[1]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if not self.in_calls:
            content, self.buffer = self.buffer, ""
            return content, []
        return self._calls(final=True)

    def _calls(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        deltas = []
        while self.buffer.startswith(self.START) or (
                self.buffer.strip().startswith(self.START)):
            body_start = self.buffer.index(self.START) + len(self.START)
            end = self.buffer.find(self.END, body_start)
            if end < 0 and not final:
                break
            body = self.buffer[body_start:end if end >= 0 else len(self.buffer)]
            self.buffer = self.buffer[end + len(self.END):] if end >= 0 else ""
            call = _parse_call(body, "arguments")
            if call is not None and (self.parallel or self.num_calls == 0):
                deltas.append(ToolCallDelta(self.num_calls, new_tool_call_id(), *call))
                self.num_calls += 1
        return "", deltas


class WholeOutputCallsStream(ToolStream):
    """An output that is either tool calls from its first character (it starts with one of
    OPENERS) or content; calls are parsed by `finish`, when the whole output is there."""

    OPENERS: tuple[str, ...] = ()

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.buffer = ""
        self.mode: str | None = None  # None: undecided, "content", "calls"

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.mode == "content":
            return text, []
        self.buffer += text
        head = self.buffer.lstrip()
        if self.mode == "calls" or not head:
            return "", []
        if head.startswith(self.OPENERS):
            self.mode = "calls"
            return "", []
        if any(opener.startswith(head) for opener in self.OPENERS):
            return "", []  # maybe an opener, still arriving
        self.mode = "content"
        content, self.buffer = self.buffer, ""
        return content, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        text, self.buffer = self.buffer, ""
        if self.mode != "calls":
            return text, []
        calls = self.parse_calls(text.strip())
        if not calls:
            return text, []  # not tool calls after all: it was content
        if not self.parallel:
            calls = calls[:1]
        deltas = [ToolCallDelta(i, new_tool_call_id(), *call) for i, call in enumerate(calls)]
        self.num_calls = len(deltas)
        return "", deltas

    def parse_calls(self, body: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON text) of each call in the stripped whole output; None or
        empty when it is not this format's calls (the output is then content)."""
        raise NotImplementedError


class Llama3JsonToolStream(WholeOutputCallsStream):
    """A whole output of JSON call objects ({"name", "parameters"}; ';'-separated)."""

    PYTHON_TAG = "<|python_tag|>"
    OPENERS = ("{", PYTHON_TAG)

    def parse_calls(self, body: str) -> list[tuple[str, str]] | None:
        calls = []
        for part in _split_json_objects(body.removeprefix(self.PYTHON_TAG)):
            call = _parse_call(part, "parameters", "arguments")
            if call is None:
                return None
            calls.append(call)
        return calls


class MarkedJsonCallsStream(ToolStream):
    """Content, then blocks of calls, each opened by one of the START markers: a JSON
    array of {"name", "arguments"} objects (or a lone object), closed by the END marker
    where the format has one, else by the array's end or the output's. A call is sent as
    soon as its object is whole; text after a closed block is content again.

        'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", ...'
         content ^marker   ^ call 0 sent once this object's last '}' has arrived

    A block that holds no calls after all (malformed, or cut short by max_tokens) is
    content, from its marker on (from its first unparsed character when some of its calls
    were sent), and so is the rest of the output: nothing the model wrote is lost.
    """

    STARTS: tuple[str, ...] = ()
    END: str | None = None

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.buffer = ""  # in content: text held back (a marker may be arriving);
        #                   in a block: the block's text from its marker on
        self.in_block = False
        self.pos = 0  # in a block: where parsing continues in `buffer`
        self.block_calls = 0
        self.failed = False

    def new_id(self) -> str:
        return new_tool_call_id()

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", []
        while True:
            if self.failed:
                content, self.buffer = content + self.buffer, ""
                return content, deltas
            if not self.in_block:
                found = [(at, m) for m in self.STARTS if (at := self.buffer.find(m)) >= 0]
                if not found:
                    keep = 0 if final else max(partial_suffix(self.buffer, m)
                                               for m in self.STARTS)
                    cut = len(self.buffer) - keep
                    content, self.buffer = content + self.buffer[:cut], self.buffer[cut:]
                    return content, deltas
                at, marker = min(found)
                content, self.buffer = content + self.buffer[:at], self.buffer[at:]
                self.in_block, self.pos, self.block_calls = True, len(marker), 0
            state = self._parse_block(deltas, final)
            if state == "wait":
                return content, deltas
            if state == "failed":
                self.failed = True
                if self.block_calls:
                    self.buffer = self.buffer[self.pos:]
                continue
            self.buffer, self.in_block = self.buffer[self.pos:], False  # closed

    def _parse_block(self, deltas: list[ToolCallDelta], final: bool) -> str:
        """Parse the open block from `pos` on: "wait" (more text needed), "closed" or
        "failed"; whole calls are appended to `deltas`."""
        while True:
            pos = self.pos
            while pos < len(self.buffer) and self.buffer[pos] in " \t\r\n,":
                pos += 1
            rest = self.buffer[pos:]
            may_grow = not final and any(m.startswith(rest) for m in (*self.STARTS, self.END)
                                         if m)
            if not rest:
                return "closed" if final else "wait"
            if self.END and rest.startswith(self.END):
                self.pos = pos + len(self.END)
                return "closed"
            if any(rest.startswith(m) for m in self.STARTS):
                self.pos = pos
                return "closed"  # the next block opens here
            if may_grow:
                return "wait"  # maybe a marker, still arriving
            if rest[0] in "[]":
                self.pos = pos + 1
                if rest[0] == "]" and self.END is None:
                    return "closed"
                continue
            if rest[0] == "{":
                end = json_value_end(self.buffer, pos)
                if end is None:
                    return "failed" if final else "wait"
                call = _parse_call(self.buffer[pos:end], "arguments", "parameters")
            else:
                end, call = self._other_call(pos, final)
                if end is None:
                    return "failed" if final or call == "failed" else "wait"
            if call is None:
                return "failed"
            self.pos = end
            self.block_calls += 1
            if self.parallel or self.num_calls == 0:
                deltas.append(ToolCallDelta(self.num_calls, self.new_id(), *call))
                self.num_calls += 1

    def _other_call(self, pos: int, final: bool) -> tuple[int | None, object]:
        """A call in the format's other syntax at `pos`: (its end, (name, arguments)),
        (None, None) while incomplete, (None, "failed") if it is none."""
        return None, "failed"


class MistralToolStream(MarkedJsonCallsStream):
    """[TOOL_CALLS] then a JSON array of calls; or, with Mistral's v11+ tokenizers,
    [TOOL_CALLS]name[ARGS]{...} for each call."""

    STARTS = ("[TOOL_CALLS]",)
    ARGS = "[ARGS]"
    _NAME = re.compile(r"[\w.\-]+")

    def new_id(self) -> str:
        return new_mistral_tool_call_id()

    def _other_call(self, pos: int, final: bool) -> tuple[int | None, object]:
        name = self._NAME.match(self.buffer, pos)
        if name is None:
            return None, "failed"
        after = self.buffer[name.end():]
        if not after.startswith(self.ARGS):
            return None, None if self.ARGS.startswith(after) and not final else "failed"
        start = name.end() + len(self.ARGS)
        while start < len(self.buffer) and self.buffer[start].isspace():
            start += 1
        end = json_value_end(self.buffer, start)
        if end is None:
            return None, None
        try:
            arguments = json.loads(self.buffer[start:end])
        except json.JSONDecodeError:
            return None, "failed"
        return end, (name.group(), json.dumps(arguments, ensure_ascii=False))


class Phi4MiniJsonToolStream(MarkedJsonCallsStream):
    """<|tool_call|>[{"name", "arguments"}, ...]<|/tool_call|> (Phi-4-mini's tokens), or
    functools[...] (the format of vLLM's Phi-4-mini template)."""

    STARTS = ("<|tool_call|>", "functools[")
    END = "<|/tool_call|>"


class PythonicToolStream(WholeOutputCallsStream):
    """A whole output that is a Python list of calls (server/chat/pythonic_calls.py), possibly
    in a ```tool_code fence; decided at the end. Anything else is content."""

    FENCE = "```tool_code"
    OPENERS = ("[", FENCE)

    def parse_calls(self, body: str) -> list[tuple[str, str]] | None:
        if body.startswith(self.FENCE):
            body = body[len(self.FENCE):].strip().removesuffix("```")
        return parse_pythonic_calls(body)


_AUTO_STREAMS = {"hermes": HermesToolStream, "llama3_json": Llama3JsonToolStream,
                 "mistral": MistralToolStream, "phi4_mini_json": Phi4MiniJsonToolStream,
                 "pythonic": PythonicToolStream}


def make_auto_stream(parser: str, parallel: bool) -> ToolStream:
    if parser not in _AUTO_STREAMS:
        raise ValueError(f"unknown tool-call parser {parser!r}; choose from {TOOL_CALL_PARSERS}")
    return _AUTO_STREAMS[parser](parallel)


def _parse_call(body: str, *argument_keys: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one call object, or None if it is not one. OpenAI's
    own shape, {"type": "function", "function": {"name", "arguments"}}, is read too."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            return obj["name"], args if isinstance(args, str) else json.dumps(
                args, ensure_ascii=False)
    return None  # e.g. {"name": "Ada", "age": 36}: an answer, not a call


def _split_json_objects(text: str) -> list[str]:
    """'{...}; {...}' -> ['{...}', '{...}']; a piece that is not JSON stays whole."""
    parts, pos = [], 0
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(text):
            break
        end = json_value_end(text, pos) if text[pos] == "{" else None
        if end is None:
            parts.append(text[pos:])
            break
        parts.append(text[pos:end])
        pos = end
    return parts
