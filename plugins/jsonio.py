"""JSON in and out of aiohttp, shared by the HTTP API and the admin routes.

orjson both ways: tree snapshots and long logprob lists are the largest bodies served.
Decoding problems raise `JSONBodyError`; each side wraps it in its own error type
(an OpenAI error object on the API, `{"type": "error"}` on the admin routes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web


class JSONBodyError(ValueError):
    """Text that is not a JSON object; the message says which of the two."""


def decode_object(raw: bytes | str) -> dict[str, Any]:
    """The JSON object in `raw`."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise JSONBodyError(f"malformed JSON: {exc}") from None
    if not isinstance(value, dict):
        raise JSONBodyError(f"must be a JSON object, got {type(value).__name__}")
    return value


def json_response(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json", headers=headers)
