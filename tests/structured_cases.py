"""Prompts and bounded JSON schemas for the structured-output tests and benchmark.

Every schema bounds what it lets through (strings have a maxLength, integers a range,
arrays a maxItems, no free-form numbers), so even a random model's output must close
well within MAX_TOKENS: the grammar forces termination, and a reply cut by the token
limit is a failure.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

MAX_TOKENS = 96
Schema = dict[str, Any]
TEXT: Schema = {"type": "string", "maxLength": 8}
SMALL: Schema = {"type": "integer", "minimum": 0, "maximum": 99}
FLAG: Schema = {"type": "boolean"}


def obj(props: dict[str, Schema], required: list[str] | None = None) -> Schema:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


def enum(*values: Any) -> Schema:
    return {"enum": list(values)}


def array(items: Schema, most: int = 3) -> Schema:
    return {"type": "array", "items": items, "maxItems": most}


CASES: list[tuple[str, Schema]] = [
    ("Describe a person.", obj({"name": TEXT, "age": SMALL})),
    ("Is the sky blue?", obj({"answer": FLAG})),
    ("Pick a colour.", obj({"colour": enum("red", "green", "blue")})),
    ("List three fruits.", obj({"fruits": array(TEXT)})),
    ("Rate the film you saw last.", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "liked": FLAG})),
    ("Where is the Eiffel tower?", obj({"city": TEXT, "country": TEXT})),
    ("Give me a point on a grid.", obj({"x": SMALL, "y": SMALL})),
    ("What is the weather like?", obj({"sky": enum("sunny", "cloudy", "rain"),
                                       "celsius": {"type": "integer", "minimum": -30, "maximum": 50}})),
    ("Recommend a book.", obj({"title": TEXT, "pages": SMALL, "tags": array(enum("fiction", "science"), 2)})),
    ("Who owns which pet?", obj({"owner": obj({"name": TEXT}), "pet": obj({"kind": enum("cat", "dog")})})),
    ("Report the API version.", obj({"version": {"const": 1}, "ok": FLAG})),
    ("Give an id, a number or a word.", obj({"id": {"anyOf": [SMALL, TEXT]}})),
    ("Leave a note, or none.", obj({"note": {"type": ["string", "null"], "maxLength": 5}})),
    ("Three small numbers, please.", {"type": "array", "items": SMALL, "minItems": 1, "maxItems": 3}),
    ("Yes, no or maybe?", enum("yes", "no", "maybe")),
    ("Fill in a form; age is optional.", obj({"name": TEXT, "age": SMALL}, required=["name"])),
    ("An airport code and a gate.", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}})),
    ("What is the date?", obj({"day": {"type": "integer", "minimum": 1, "maximum": 31},
                               "month": enum("jan", "feb", "mar")})),
    ("Which switches are on?", obj({"switches": array(FLAG, 4)})),
    ("Go three levels deep.", obj({"a": obj({"b": obj({"c": SMALL})})})),
]


def follows(text: str, finish_reason: str | None, schema: Schema) -> None:
    """The reply is complete JSON valid under `schema` (raises otherwise)."""
    assert finish_reason == "stop", f"finish_reason {finish_reason!r} for {text!r}"
    jsonschema.validate(json.loads(text), schema)


def response_format(schema: Schema, name: str = "reply") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
