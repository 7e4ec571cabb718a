"""OpenAI's `response_format` -> the engine's `json_schema` (structured outputs).

`{"type": "text"}` constrains nothing; `{"type": "json_object"}` is any JSON object (the
schema `{"type": "object"}`); `{"type": "json_schema", "json_schema": {"name", "schema",
"strict", "description"}}` follows `schema`. The schema itself is checked and compiled
by the engine (kernel/structured/grammar.py) before the request is answered.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from plugins.http.errors import bad_request

JSON_OBJECT_SCHEMA = '{"type": "object"}'
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


@dataclass(frozen=True)
class JsonSchemaFormat:
    name: str = field(metadata={"schema": {"pattern": "^[A-Za-z0-9_-]{1,64}$"}})
    schema: dict[str, Any]  # the JSON Schema the output follows
    description: str | None = None
    strict: bool | None = None  # accepted; the output always follows the schema


@dataclass(frozen=True)
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type json_schema


def response_schema(body: dict[str, Any]) -> str | None:
    """The JSON Schema text `response_format` asks for; None for none or plain text."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object", param="response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          param="response_format")
    return _schema_text(fmt.get("json_schema"))


def _schema_text(spec: object) -> str:
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"{param} must be an object with a name and a schema", param=param)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{param}.name must be 1-64 letters, digits, _ or -, got {name!r}", param=param)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{param}.schema must be a JSON Schema object, got {type(schema).__name__}", param=param)
    return json.dumps(schema)
