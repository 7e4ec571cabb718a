"""Who may use the admin API.

With `server.admin_api_key` set, a client proves it holds the key: an
`Authorization: Bearer <key>` header, or (websocket only, because browsers cannot set
headers on a websocket upgrade) a first message `{"type": "auth", "key": ...}`.
Without a key, only loopback clients are served, and a request carrying a browser
`Origin` that is not loopback is refused: websockets are exempt from CORS, so without
that check any web page open on this machine could drive the admin socket
(cross-site websocket hijacking, DNS rebinding).
"""

from __future__ import annotations

import ipaddress
from enum import Enum
from urllib.parse import urlsplit

from aiohttp import web

from plugins.bearer import bearer_token, key_matches
from plugins.jsonio import json_response

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class Verdict(Enum):
    ALLOWED = "allowed"
    NEEDS_KEY = "needs_key"  # no credentials yet: a websocket may still send them first
    BAD_KEY = "bad_key"  # 401
    FORBIDDEN = "forbidden"  # 403


def judge(request: web.Request, admin_key: str | None) -> Verdict:
    """Decide on a request from its headers and peer address alone."""
    if admin_key is None:
        if is_loopback(request.remote) and origin_is_local(request.headers.get("Origin")):
            return Verdict.ALLOWED
        return Verdict.FORBIDDEN
    given = bearer_token(request.headers.get("Authorization"))
    if given is None:
        return Verdict.NEEDS_KEY
    return Verdict.ALLOWED if key_matches(given, admin_key) else Verdict.BAD_KEY


def refusal(verdict: Verdict) -> web.Response:
    """The HTTP answer to a request that is not ALLOWED (before any upgrade)."""
    if verdict is Verdict.FORBIDDEN:
        return json_response(
            {"type": "error", "message": "admin API: loopback clients only (no server.admin_api_key set)"},
            status=403,
        )
    return json_response(
        {"type": "error", "message": "admin API: missing or wrong bearer key"},
        status=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


def origin_is_local(origin: str | None) -> bool:
    """No Origin (not a browser) or a loopback one."""
    if origin is None:
        return True
    host = urlsplit(origin).hostname
    return host is not None and (host in _LOOPBACK_NAMES or is_loopback(host))
