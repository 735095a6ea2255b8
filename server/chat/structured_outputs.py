"""The request surface of structured outputs -> one StructuredOutputsParams, or a 400.

Accepted, on chat and completions (at most one per request):
  response_format    {"type": "json_object"} | {"type": "json_schema", "json_schema":
                     {"name", "schema", "strict", "description"}} | {"type": "text"}
  structured_outputs vLLM's extra: {"json": schema} | {"regex"} | {"choice"} | {"grammar"}
                     | {"json_object": true}
  guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older names

The spec is checked (engine/structured_output/validation.py) on a worker thread with a
time limit, so a hostile regex or schema cannot hold up the event loop; the engine
compiles it later, off its step loop.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from engine.structured_output import StructuredOutputsParams
from engine.structured_output.validation import StructuredOutputError, check_spec
from server.common.errors import bad_request
from server.common.protocol import SamplingFields

if TYPE_CHECKING:
    from engine.frontend.async_engine import AsyncEngine

CHECK_TIMEOUT_S = 5.0


def requested_params(body: SamplingFields) -> tuple[str, StructuredOutputsParams] | None:
    """(the field that asked, its params), from whichever field the request used."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutputsParams("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs a 'json_schema' "
                              "object.", "response_format.json_schema", "invalid_value")
        schema = fmt.json_schema.schema_
        found.append(("response_format.json_schema.schema",
                      StructuredOutputsParams("json", _schema_text(schema if schema is not None
                                                                   else {}))))
    so = body.structured_outputs
    if so is not None:
        for name, params in (
            ("json", None if so.json_ is None else StructuredOutputsParams(
                "json", _schema_text(so.json_))),
            ("regex", None if so.regex is None else StructuredOutputsParams("regex", so.regex)),
            ("choice", None if so.choice is None else StructuredOutputsParams(
                "choice", json.dumps(so.choice))),
            ("grammar", None if so.grammar is None else StructuredOutputsParams(
                "grammar", so.grammar)),
            ("json_object", StructuredOutputsParams("json_object") if so.json_object else None),
        ):
            if params is not None:
                found.append((f"structured_outputs.{name}", params))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is None:
            continue
        spec = (_schema_text(value) if kind == "json"
                else json.dumps(value) if kind == "choice" else value)
        found.append((name, StructuredOutputsParams(kind, spec)))
    if len(found) > 1:
        raise bad_request("Only one structured output may be asked for; got "
                          + ", ".join(name for name, _ in found) + ".",
                          found[1][0], "invalid_value")
    return found[0] if found else None


async def check_params(param: str, params: StructuredOutputsParams, engine: AsyncEngine) -> None:
    """A 400 naming `param` when the spec is invalid, unsupported, or too slow to check.

    The cheap checks run on a worker thread here; the grammar library's own (by
    compiling the spec, which the request then reuses) in the engine core; both within
    CHECK_TIMEOUT_S."""
    async def check() -> str | None:
        await asyncio.to_thread(check_spec, params)  # jsonschema: off the event loop
        return await engine.check_grammar(params)

    try:
        error = await asyncio.wait_for(check(), CHECK_TIMEOUT_S)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), param, "invalid_value") from None
    except asyncio.TimeoutError:
        raise bad_request(f"checking the {params.kind} spec took longer than "
                          f"{CHECK_TIMEOUT_S:g} s; simplify it.", param, "invalid_value") from None
    if error is not None:
        raise bad_request(error, param, "invalid_value")


async def structured_outputs_of(body: SamplingFields, engine: AsyncEngine
                                ) -> StructuredOutputsParams | None:
    """The request's checked structured-output params, or None for free text."""
    requested = requested_params(body)
    if requested is None:
        return None
    param, params = requested
    await check_params(param, params, engine)
    return params


def _schema_text(schema: Any) -> str:
    """A schema given as an object or as JSON text, as JSON text."""
    if isinstance(schema, str):
        return schema
    return json.dumps(schema)
