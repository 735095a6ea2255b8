"""Checks a structured-output spec before it reaches the engine (tokenizer-free).

`check_spec` raises `StructuredOutputError` naming what is wrong:
  * a spec longer than `MAX_SPEC_CHARS`, or a length/count bound above `MAX_REPEAT`
    (what makes a grammar large and its compile slow);
  * a JSON schema that is not valid against its metaschema (`jsonschema`);
  * JSON-schema keywords the grammar library would silently ignore (`not`, `if`, ...),
    so an output could miss the schema while the client trusted it.
What the grammar library itself refuses (a regex or EBNF syntax error, an unsupported
regex feature, a `$ref` that resolves nowhere) is found by compiling the spec, which
happens in the engine core (`StructuredOutputManager.check`): the library imports torch,
which the HTTP frontend does not load.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.structured_output.params import StructuredOutputsParams

MAX_SPEC_CHARS = 64 * 1024
MAX_REPEAT = 1024  # minLength / maxItems / {m,n} ... above this are refused
MAX_CHOICES = 1024

# Keywords the grammar cannot enforce; accepting them would promise what we cannot keep.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "unevaluatedProperties", "unevaluatedItems",
})
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                   "maxProperties", "minContains", "maxContains")
# Keywords whose value is a map of name -> subschema (the names are not keywords).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_REGEX_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class StructuredOutputError(ValueError):
    """An invalid or unsupported structured-output spec."""


def check_spec(params: StructuredOutputsParams) -> None:
    if len(params.spec) > MAX_SPEC_CHARS:
        raise StructuredOutputError(
            f"the {params.kind} spec is {len(params.spec)} characters long; at most "
            f"{MAX_SPEC_CHARS} are accepted")
    if params.kind == "json":
        _check_schema(params.spec)
    elif params.kind == "regex":
        _check_regex_counts(params.spec, "regex")
    elif params.kind == "choice":
        choices = json.loads(params.spec)
        if not choices or len(choices) > MAX_CHOICES:
            raise StructuredOutputError(f"choice needs 1 to {MAX_CHOICES} strings")


def _check_schema(spec: str) -> None:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError("a JSON schema must be an object or a boolean")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(root)"
        raise StructuredOutputError(f"invalid JSON schema at {where}: {exc.message}") from None
    _walk(schema, "#")


def _walk(node: Any, where: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk(item, f"{where}/{i}")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        path = f"{where}/{key}"
        if key in UNSUPPORTED_KEYWORDS:
            raise StructuredOutputError(f"JSON schema keyword {key!r} (at {path}) is not "
                                        "supported for structured outputs")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise StructuredOutputError(f"'allOf' with more than one schema (at {path}) is "
                                        "not supported for structured outputs")
        if key in _COUNT_KEYWORDS and isinstance(value, int) and value > MAX_REPEAT:
            raise StructuredOutputError(f"{key} {value} (at {path}) is above the limit of "
                                        f"{MAX_REPEAT}")
        if key == "pattern" and isinstance(value, str):
            _check_regex_counts(value, path)
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{path}/{name}")
        elif key not in ("enum", "const", "default", "examples", "required"):
            _walk(value, path)


def _check_regex_counts(pattern: str, where: str) -> None:
    for match in _REGEX_COUNT.finditer(pattern):
        for number in match.groups():
            if number and int(number) > MAX_REPEAT:
                raise StructuredOutputError(
                    f"repetition {match.group(0)} in {where} is above the limit of {MAX_REPEAT}")
