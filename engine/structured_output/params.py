"""What a request asks its output to match: one grammar spec, as the engine sees it.

The frontend turns every request surface (response_format, structured_outputs,
guided_*, tool_choice) into one `StructuredOutputsParams`. `(kind, spec)` is also
the key of the engine's compiled-grammar cache, so equal specs compile once.

    kind          spec
    json          a JSON schema, as JSON text
    json_object   "" (any JSON object)
    regex         a regular expression (the whole output matches it)
    choice        a JSON list of strings (the output is exactly one of them)
    grammar       an EBNF grammar (xgrammar's dialect, GBNF-like; root rule `root`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]
GRAMMAR_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    kind: GrammarKind
    spec: str = ""
    # The grammar applies only after the output holds this token (a reasoning model's
    # end of thinking, e.g. `</think>`): the thinking before it is free. None: at once.
    after_token_id: int | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.spec)
