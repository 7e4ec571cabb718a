"""Reading request bodies: JSON, typed fields, prompts and chat messages.

Every check names the offending field, so a client sees exactly what to fix, and all of
them run before anything reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast

from aiohttp import web

from plugins.http.errors import APIError, bad_request
from plugins.http.tool_messages import MessageToolCall, check_tool_replies, tool_fields
from plugins.jsonio import JSONBodyError, decode_object

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_N = 16

Prompt = str | list[int]
PromptInput = str | list[str] | list[int] | list[list[int]]  # what `prompt` may be on the wire


def bounds(lo: int, hi: int) -> dict[str, Any]:
    """Field metadata for /openapi.json: the range `get_int` enforces."""
    return {"schema": {"minimum": lo, "maximum": hi}}


# The wire shapes these readers accept, as /openapi.json documents them (plugins/http/openapi.py).
@dataclass(frozen=True)
class StreamOptions:
    include_usage: bool | None = False


@dataclass(frozen=True)
class TextPart:
    type: Literal["text"]
    text: str


@dataclass(frozen=True)
class ChatMessage:
    role: str = field(metadata={"schema": {"minLength": 1}})  # "developer" is read as "system"
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call they answer


async def read_body(request: web.Request) -> dict[str, Any]:
    """The JSON object of the request; 413 is decided from Content-Length, before reading."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise APIError(413, f"request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    raw = await request.read()  # aiohttp's client_max_size bounds chunked bodies too
    if not raw:
        raise bad_request("request body is empty; send a JSON object")
    try:
        return decode_object(raw)
    except JSONBodyError as exc:
        raise bad_request(f"request body: {exc}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def get_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def get_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"{name} must be an integer, got {value!r}", param=name)
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be in [{lo}, {hi}], got {value}", param=name)
    return int(value)


def get_n(body: dict[str, Any]) -> int:
    n = get_int(body, "n", 1, MAX_N)
    return 1 if n is None else n


def check_model(body: dict[str, Any], served: str) -> None:
    """`model` may be left out; if given it must name the served model."""
    model = body.get("model")
    if model is None or model == served:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {model!r}", param="model")
    raise bad_request(
        f"the model `{model}` does not exist; this server serves `{served}`", param="model",
        code="model_not_found",
    )


def reject_unsupported(body: dict[str, Any], harmless: dict[str, tuple[Any, ...]]) -> None:
    """Fields that would change the answer but are not implemented: refuse, never ignore.

    `harmless` lists, per field, the values that mean "not used" and so are accepted.
    """
    for name, accepted in harmless.items():
        value = body.get(name)
        if value is not None and value not in accepted:
            raise bad_request(f"{name} is not supported by this server", param=name)


def get_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options without stream is an error, as with OpenAI."""
    stream = get_bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    return stream, get_bool(options, "include_usage")


def _is_id_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def parse_prompts(value: object, param: str = "prompt") -> list[Prompt]:
    """A string, list of strings, token ids, or list of token-id lists -> list of prompts."""
    if value is None:
        raise bad_request(f"{param} is required", param=param)
    if isinstance(value, str):
        prompts: list[Prompt] = [value]
    elif _is_id_list(value):
        prompts = [cast(list[int], value)]
    elif isinstance(value, list) and value and all(isinstance(p, str) or _is_id_list(p) for p in value):
        prompts = list(value)
    else:
        raise bad_request(
            f"{param} must be a non-empty string, list of strings, list of token ids or list of "
            "token-id lists", param=param,
        )
    if any(p == "" for p in prompts):
        raise bad_request(f"{param} is empty", param=param)
    return prompts


def parse_messages(value: object) -> list[dict[str, Any]]:
    """OpenAI chat messages -> plain {role, content} dicts for the chat template (plus
    `tool_calls` / `tool_call_id` where given: plugins/http/tool_messages.py)."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of message objects", param="messages")
    messages = [_parse_message(i, m) for i, m in enumerate(value)]
    check_tool_replies(messages)
    return messages


def _parse_message(i: int, message: object) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object", param=param)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise bad_request(f"{param}.role must be a non-empty string", param=f"{param}.role")
    # Templates know "system"; "developer" is OpenAI's newer name for the same thing.
    role = "system" if role == "developer" else role
    return {"role": role, "content": _content_text(message.get("content"), f"{param}.content"),
            **tool_fields(role, message, param)}


def _content_text(content: object, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param=param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{param}: only text content parts are supported", param=param)
        texts.append(part["text"])
    return "\n".join(texts)
