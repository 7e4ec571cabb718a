"""The tool parts of chat messages: an assistant's `tool_calls`, a tool's `tool_call_id`.

They become the Hugging Face template convention: each call as {"id", "type": "function",
"function": {"name", "arguments"}} with `arguments` decoded to an object (templates write
it with `tojson`); text that is not a JSON object stays the string it was.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from plugins.http.errors import bad_request


# The wire shapes, as /openapi.json documents them (plugins/http/openapi.py).
@dataclass(frozen=True)
class CalledFunction:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class MessageToolCall:
    id: str
    type: Literal["function"]
    function: CalledFunction


def tool_fields(role: str, message: dict[str, Any], param: str) -> dict[str, Any]:
    """The template fields a message's tool parts add (none for plain messages)."""
    out: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise bad_request(f"{param}: only assistant messages have tool_calls", param=f"{param}.tool_calls")
        if not isinstance(calls, list):
            raise bad_request(f"{param}.tool_calls must be a list", param=f"{param}.tool_calls")
        out["tool_calls"] = [_call(c, f"{param}.tool_calls[{i}]") for i, c in enumerate(calls)]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{param}: a tool message needs tool_call_id (the id of the call it answers)",
                              param=f"{param}.tool_call_id")
        out["tool_call_id"] = call_id
    return out


def _call(call: object, param: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise bad_request(f"{param} must be an object", param=param)
    call_id, function = call.get("id"), call.get("function")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{param}.id must be a non-empty string", param=f"{param}.id")
    if call.get("type", "function") != "function":
        raise bad_request(f'{param}.type must be "function"', param=f"{param}.type")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise bad_request(f"{param}.function must be an object with a name", param=f"{param}.function")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise bad_request(f"{param}.function.arguments must be a string (JSON text)",
                          param=f"{param}.function.arguments")
    return {"id": call_id, "type": "function", "function": {"name": function["name"], "arguments": _decoded(arguments)}}


def _decoded(arguments: str) -> dict[str, Any] | str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def check_tool_replies(messages: list[dict[str, Any]]) -> None:
    """Each tool message answers a call made by an assistant message before it (as OpenAI checks)."""
    made: set[str] = set()
    for i, message in enumerate(messages):
        made.update(c["id"] for c in message.get("tool_calls", ()))
        call_id = message.get("tool_call_id")
        if message["role"] == "tool" and call_id not in made:
            raise bad_request(f"messages[{i}]: tool_call_id {call_id!r} answers no tool call of an earlier "
                              "assistant message", param=f"messages[{i}].tool_call_id")
