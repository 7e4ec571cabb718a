"""The JSON Schema a forced tool call is generated under (tool_choice required or named).

What the model writes (and plugins/http/tool_reply.py reads back):

- named: the function's arguments object itself, under its `parameters` schema (the
  name is known, so it is not generated);
- required: one call object `{"name": <function>, "arguments": {...}}`, under `anyOf`
  over the offered functions (`name` a `const`, `arguments` that function's parameters).
  One call per reply: a forced reply never holds parallel calls.

A function's parameters may use local references (`$ref` "#/..." into its own `$defs`);
moved under the call object, they are rewritten to point into their new place.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kernel.sampling_params import GRAMMAR_FIELDS, SamplingParams
from plugins.http.errors import bad_request
from plugins.http.tools import Function, ToolUse


def forced_schema(use: ToolUse) -> str | None:
    """The schema (JSON text, SamplingParams.json_schema) that generation must follow; None
    unless the request forces a call."""
    if use.mode == "named" and use.named is not None:
        return json.dumps(use.named.parameters)
    if use.mode != "required":
        return None
    if len(use.functions) == 1:
        return json.dumps(call_object(use.functions[0], "#"))
    return json.dumps({"anyOf": [call_object(f, f"#/anyOf/{i}") for i, f in enumerate(use.functions)]})


def with_forced_call(params: SamplingParams, use: ToolUse) -> SamplingParams:
    """`params` generating under the forced call's schema (unchanged if none is forced)."""
    schema = forced_schema(use)
    if schema is None:
        return params
    given = [name for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    if given:  # a chat request's json_schema is its response_format
        field = "response_format" if given[0] == "json_schema" else given[0]
        raise bad_request(f"tool_choice {use.mode} generates the call under its own schema; it cannot be "
                          f"combined with {field}", param="tool_choice")
    return dataclasses.replace(params, json_schema=schema)


def call_object(function: Function, at: str) -> dict[str, Any]:
    """The schema of one call of `function`, to be placed at JSON pointer `at`."""
    return {
        "type": "object",
        "properties": {"name": {"const": function.name},
                       "arguments": relocated(function.parameters, f"{at}/properties/arguments")},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def relocated(schema: Any, base: str) -> Any:
    """`schema` with its local references ("#", "#/...") pointing under `base` (a JSON
    pointer fragment such as "#/anyOf/0/properties/arguments")."""
    if isinstance(schema, list):
        return [relocated(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        else:
            out[key] = relocated(value, base)
    return out
