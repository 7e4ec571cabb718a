"""Bearer-key check: with `server.api_key` set, every route but /health needs it."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from plugins.bearer import has_bearer_key
from plugins.http.errors import APIError

OPEN_PATHS = frozenset({"/health"})  # probes must work without secrets
ADMIN_PREFIX = "/admin/"  # guarded by server.admin_api_key (or loopback), see plugins/admin
ADMIN_PAGE = "/admin"  # redirects to the inspector page, /admin/


def auth_middleware(api_key: str) -> Middleware:
    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        guarded = path not in OPEN_PATHS and path != ADMIN_PAGE and not path.startswith(ADMIN_PREFIX)
        if guarded and not has_bearer_key(request.headers.get("Authorization"), api_key):
            raise APIError(
                401, "missing or incorrect API key: send Authorization: Bearer <key>", code="invalid_api_key",
            )
        return await handler(request)

    return check_key
