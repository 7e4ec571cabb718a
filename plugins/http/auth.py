"""Bearer-key check: with `server.api_key` set, every route but /health needs it."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from plugins.bearer import has_bearer_key
from plugins.http.errors import APIError

OPEN_PATHS = frozenset({"/health"})  # probes must work without secrets
ADMIN_PREFIX = "/admin/"  # guarded by server.admin_api_key (or loopback), see plugins/admin


def auth_middleware(api_key: str) -> Middleware:
    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        guarded = request.path not in OPEN_PATHS and not request.path.startswith(ADMIN_PREFIX)
        if guarded and not has_bearer_key(request.headers.get("Authorization"), api_key):
            raise APIError(
                401, "missing or incorrect API key: send Authorization: Bearer <key>", code="invalid_api_key",
            )
        return await handler(request)

    return check_key
