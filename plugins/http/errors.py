"""OpenAI-style error objects, and the middleware that turns every failure into one."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from kernel.sampling_params import SamplingParams, SamplingParamsError
from plugins.jsonio import json_response

log = structlog.get_logger("tierserve")

# Error `type` per status, as OpenAI names them where it has a name.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class ErrorDetail:
    """OpenAI's error object: the `error` of every refusal (and its /openapi.json schema)."""

    message: str
    type: str
    param: str | None
    code: str | None


@dataclass(frozen=True)
class ErrorBody:
    error: ErrorDetail


class APIError(Exception):
    """A failure answered as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": dataclasses.asdict(ErrorDetail(self.message, kind, self.param, self.code))}

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def halted(reason: str) -> APIError:
    """The engine's step loop has stopped for good: nothing more will be generated."""
    return APIError(503, f"the engine has halted: {reason}", code="engine_halted")


def client_words(message: str, names: Mapping[str, str]) -> str:
    """An engine message in the client's words.

    The engine speaks its own field names (max_new_tokens, top_logprobs_num); `names`
    maps them back to what this endpoint's client wrote (max_tokens, logprobs).
    """
    for engine_name, client_name in names.items():
        message = message.replace(engine_name, client_name)
    return message


def sampling_error(exc: SamplingParamsError, names: Mapping[str, str]) -> APIError:
    """A 400 that names the client's parameter (the engine's `param`, in the client's words)."""
    param = names.get(exc.param, exc.param) if exc.param is not None else None
    return bad_request(client_words(str(exc), names), param=param)


def _status_message(exc: web.HTTPException, request: web.Request) -> tuple[str, str | None]:
    if exc.status == 404:
        return f"no route {request.method} {request.path}", "not_found"
    if exc.status == 405:
        return f"method {request.method} is not allowed on {request.path}", "method_not_allowed"
    if exc.status == 413:
        return "request body is too large", "request_too_large"
    return exc.reason, None


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        if exc.status >= 500:
            log.warning("request_failed", path=request.path, status=exc.status, error=exc.message)
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message, code = _status_message(exc, request)
        return APIError(exc.status, message, code=code).response()
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client is gone: nothing to answer
    except Exception:
        log.exception("handler_crashed", path=request.path)
        return APIError(500, "internal server error").response()
