"""Python-syntax tool calls, the `pythonic` format: `[get_weather(city="Paris"), now()]`.

vLLM serves Gemma 3 (which has no tool tokens) with this format: the chat template lists
the functions and asks for a Python list of calls with keyword arguments. Parsed with
`ast`, never evaluated: a call's arguments must be literals (strings, numbers, booleans,
None, and lists / dicts of them; JSON's true / false / null are read too).

    parse_pythonic_calls('[f(a=1, b="x"), g()]') -> [("f", '{"a": 1, "b": "x"}'), ("g", "{}")]
    parse_pythonic_calls("The answer is [1, 2].")  -> None (not a list of calls)
"""

from __future__ import annotations

import ast
import json
from typing import Any

_NAMED_CONSTANTS = {"true": True, "false": False, "null": None}


def parse_pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON text) of each call in `text`, a Python list of calls with
    keyword arguments only; None when `text` is anything else."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted_name(node.func)
        if name is None or any(keyword.arg is None for keyword in node.keywords):
            return None  # f(**kwargs), (lambda: 1)(), ...
        try:
            arguments = {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
        except ValueError:
            return None
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _dotted_name(node: ast.expr) -> str | None:
    """`f` -> "f", `tools.search` -> "tools.search"; anything else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        parent = _dotted_name(node.value)
        return None if parent is None else f"{parent}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    """A JSON value from a literal expression; ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(
            node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if all(isinstance(key, str) for key in keys):
            return {key: _literal(value) for key, value in zip(keys, node.values, strict=True)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")
