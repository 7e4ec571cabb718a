"""Which key a route needs, and the bearer-key check of the API key.

With `server.api_key` set, every route needs it but the open ones (/health, /openapi.json)
and the admin ones, which check `server.admin_api_key` themselves (plugins/admin/auth.py),
except the inspector page and its files, which are public. `guard_of` is the one place
that says which is which: the middleware below and /openapi.json both read it.
"""

from __future__ import annotations

from enum import Enum

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from plugins.admin.page import is_public
from plugins.bearer import has_bearer_key
from plugins.http.errors import APIError

# Probes must work without secrets; the API's description holds none (no key, no config).
OPEN_PATHS = frozenset({"/health", "/openapi.json"})
ADMIN_PREFIX = "/admin/"  # guarded by server.admin_api_key (or loopback), see plugins/admin
ADMIN_PAGE = "/admin"  # redirects to the inspector page, /admin/


class Guard(Enum):
    OPEN = "none"
    API_KEY = "api_key"  # server.api_key, when set
    ADMIN_KEY = "admin_key"  # server.admin_api_key; without one, loopback clients only


def guard_of(path: str) -> Guard:
    """The key a request path (or a route's path pattern) needs."""
    if path in OPEN_PATHS or is_public(path):
        return Guard.OPEN
    if path == ADMIN_PAGE or path.startswith(ADMIN_PREFIX):
        return Guard.ADMIN_KEY
    return Guard.API_KEY


def auth_middleware(api_key: str) -> Middleware:
    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if guard_of(request.path) is Guard.API_KEY and not has_bearer_key(
            request.headers.get("Authorization"), api_key
        ):
            raise APIError(
                401, "missing or incorrect API key: send Authorization: Bearer <key>", code="invalid_api_key",
            )
        return await handler(request)

    return check_key
