"""`tools` and `tool_choice` of a chat request: read, checked, and what they ask for.

Every check runs before anything reaches the engine and names the offending field. A
function's `parameters` must be a valid JSON Schema (checked against its draft's
meta-schema), because `required` and named choices constrain generation to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema

from plugins.http.errors import bad_request
from plugins.http.protocol import get_bool

NAME_PATTERN = "^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
_NAME = re.compile(NAME_PATTERN)
MAX_TOOLS = 128  # OpenAI's limit
Mode = Literal["none", "auto", "required", "named"]
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # `parameters` left out


# The wire shapes, as /openapi.json documents them (plugins/http/openapi.py).
@dataclass(frozen=True)
class FunctionDef:
    name: str = field(metadata={"schema": {"pattern": NAME_PATTERN}})
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None  # arguments always follow the schema when the choice forces a call


@dataclass(frozen=True)
class Tool:
    type: Literal["function"]
    function: FunctionDef


@dataclass(frozen=True)
class FunctionName:
    name: str


@dataclass(frozen=True)
class NamedToolChoice:
    type: Literal["function"]
    function: FunctionName


@dataclass(frozen=True)
class Function:
    """One function the request offers the model."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI (and Hugging Face template) form: {"type": "function", "function": {...}}."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """What the request asks: the functions offered and how the model may use them."""

    functions: tuple[Function, ...]
    mode: Mode
    named: Function | None = None  # mode "named": the function it must call
    parallel: bool = True  # parallel_tool_calls: more than one call per reply

    @property
    def rendered(self) -> tuple[Function, ...]:
        """The functions the prompt shows: none when the model may not call any."""
        return () if self.mode == "none" else self.functions

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)


def parse_tool_use(body: dict[str, Any]) -> ToolUse:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> ToolUse; `functions` (the
    deprecated form) is refused unless empty."""
    if body.get("functions") not in (None, []):
        raise bad_request("functions is deprecated and not supported; send tools", param="functions")
    if body.get("function_call") is not None:
        raise bad_request("function_call is deprecated and not supported; send tool_choice",
                          param="function_call")
    functions = parse_tools(body.get("tools"))
    parallel = get_bool(body, "parallel_tool_calls", True)
    choice = body.get("tool_choice")
    if choice is None:  # OpenAI's default
        return ToolUse(functions, "auto" if functions else "none", parallel=parallel)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                              param="tool_choice")
        if choice == "required" and not functions:
            raise bad_request('tool_choice "required" needs tools', param="tool_choice")
        mode: Mode = "none" if not functions else choice  # type: ignore[assignment]
        return ToolUse(functions, mode, parallel=parallel)
    return ToolUse(functions, "named", _named(choice, functions), parallel)


def parse_tools(value: object) -> tuple[Function, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request("tools must be a list of tool objects", param="tools")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"tools has {len(value)} entries; at most {MAX_TOOLS} are allowed", param="tools")
    functions = tuple(_tool(i, t) for i, t in enumerate(value))
    seen: set[str] = set()
    for i, f in enumerate(functions):
        if f.name in seen:
            raise bad_request(f"tools[{i}]: the function name {f.name!r} is used twice",
                              param=f"tools[{i}].function.name")
        seen.add(f.name)
    return functions


def _tool(i: int, tool: object) -> Function:
    param = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad_request(f"{param} must be an object", param=param)
    if tool.get("type") != "function":
        raise bad_request(f'{param}.type must be "function", got {tool.get("type")!r}', param=f"{param}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{param}.function must be an object", param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{param}.function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                          param=f"{param}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{param}.function.description must be a string", param=f"{param}.function.description")
    if function.get("strict") is not None and not isinstance(function.get("strict"), bool):
        raise bad_request(f"{param}.function.strict must be a boolean", param=f"{param}.function.strict")
    parameters = function.get("parameters")
    return Function(name, description, NO_PARAMETERS if parameters is None else
                    _schema(parameters, f"{param}.function.parameters"))


def _schema(schema: object, param: str) -> dict[str, Any]:
    """A JSON Schema of an arguments object, checked against its draft's meta-schema."""
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON Schema object", param=param)
    if schema.get("type", "object") != "object":
        raise bad_request(f'{param} must describe an object (type "object"), got type {schema["type"]!r}',
                          param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise bad_request(f"{param} is not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else ""),
                          param=param) from None
    return schema


def _named(choice: object, functions: tuple[Function, ...]) -> Function:
    shape = 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise bad_request(shape, param="tool_choice")
    name = choice["function"].get("name")
    if not isinstance(name, str):
        raise bad_request("tool_choice.function.name must be a string", param="tool_choice.function.name")
    for function in functions:
        if function.name == name:
            return function
    known = [f.name for f in functions]
    raise bad_request(f"tool_choice names the function {name!r}, which is not in tools ({known})",
                      param="tool_choice.function.name")
