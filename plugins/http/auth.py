"""Bearer-key check: with `server.api_key` set, every route but /health needs it."""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from plugins.http.errors import APIError

OPEN_PATHS = frozenset({"/health"})  # probes must work without secrets
ADMIN_PREFIX = "/admin/"  # guarded by server.admin_api_key (or loopback), see plugins/admin


def auth_middleware(api_key: str) -> Middleware:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not request.path.startswith(ADMIN_PREFIX):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):  # constant time: no key guessing by timing
                raise APIError(
                    401, "missing or incorrect API key: send Authorization: Bearer <key>",
                    code="invalid_api_key",
                )
        return await handler(request)

    return check_key
