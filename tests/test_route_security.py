"""Every route checks the key it needs; a new route cannot slip through.

The routes are read from the app's router (and the engine routes' inner router), never
listed here: each is called without a key, with wrong ones and with its own. The only
list is PUBLIC (and the websocket's first-message exemption), each with its reason, and
a route that answers without a key but is not listed there fails. Keys never show in a
response or a log line, and are compared with hmac.compare_digest.
"""

from __future__ import annotations

import hmac
import logging
import re
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web
from structlog.testing import capture_logs

import plugins.bearer
from plugins.admin.page import STATIC_DIR
from plugins.http.engine_routes import ENGINE_ROUTES, PATHS
from tests.inprocess import Client, serve_http

API_KEY, ADMIN_KEY = "sk-route-security-7f3a", "adm-route-security-91c2"
KEYS = {"server.api_key": API_KEY, "server.admin_api_key": ADMIN_KEY}

# The routes anyone may call with server.api_key and server.admin_api_key both set.
PUBLIC: dict[str, str] = {
    "/health": "probes (load balancers, orchestrators) run without secrets",
    "/openapi.json": "describes the API: holds no key and no config, only what the README says",
    "/admin": "a redirect to the inspector page",
    "/admin/": "the inspector page holds no data; it asks for the key to open the socket",
    "/admin/static/{name}": "the inspector page's own scripts and styles",
}
# Answers a keyless upgrade, then wants the key as the first message (and closes, 1008).
FIRST_MESSAGE_AUTH: dict[str, str] = {
    "/admin/ws": "browsers cannot set headers on a websocket upgrade",
}
# Dummy values for path parameters: a name that exists, so the right key gets a 200.
STATIC_FILE = min(p.name for p in STATIC_DIR.iterdir())
# Paths that must not sneak past the key check by their spelling (no key: 401 or 404).
TRICKS = ("/health/../server_info", "/admin/../server_info", "/admin/%2e%2e/server_info", "/ADMIN/stats",
          "/Health", "/server_info/", "/./server_info", "/v1//models", "/admin/static/../../server_info", "/admin/static/%2e%2e/stats")


def all_routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path pattern) of every route, HEAD twins included; mount points aside."""
    inner = app[ENGINE_ROUTES].inner
    assert inner is not None, "bind the engine routes first"
    routes = []
    for route in [*app.router.routes(), *inner.router.routes()]:
        assert route.resource is not None
        pattern = route.resource.canonical
        if route.method == "*":  # the mount points stand for the inner routes, each checked
            assert pattern in {re.sub(r":[^}]*", "", p) for p in PATHS}, f"a catch-all route {pattern}"
            continue
        routes.append((route.method, pattern))
    return routes


def concrete(pattern: str, model: str) -> str:
    values = {"model": model, "name": STATIC_FILE}
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), "x"), pattern)


def keys_of(pattern: str) -> tuple[str, str]:
    """(the route's key, the other one): the admin key for /admin*, else the API key."""
    return (ADMIN_KEY, API_KEY) if pattern.startswith("/admin") else (API_KEY, ADMIN_KEY)


async def call(client: Client, method: str, url: str, auth: str | None) -> tuple[int, str]:
    headers = {} if auth is None else {"Authorization": auth}
    body: dict[str, Any] | None = {} if method == "POST" else None
    async with client.request(method, url, headers=headers, json=body, allow_redirects=False) as resp:
        return resp.status, await resp.text()


def assert_no_key(text: str, where: str) -> None:
    assert API_KEY not in text and ADMIN_KEY not in text, f"a key shows in {where}"


async def test_every_route_checks_its_key(
    tiny_chat_folder: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    async with serve_http(tiny_chat_folder, KEYS) as (engine, client):
        routes = all_routes(client.app)
        patterns = {p for _, p in routes}
        assert not (set(PUBLIC) | set(FIRST_MESSAGE_AUTH)) - patterns, "an exemption names no route"
        failures: list[str] = []
        with capture_logs() as logs:
            for method, pattern in routes:
                failures += await check_route(client, method, pattern, engine.info.model_name)
            for path in TRICKS:
                status, _ = await call(client, "GET", path, None)
                if status not in (401, 404):
                    failures.append(f"GET {path} without a key: {status}")
            await check_first_message_auth(client)
        assert not failures, "\n".join(failures)
        assert len(routes) >= 30  # the whole app: API, native, admin, page, metrics
        assert_no_key(repr(logs), "structlog events")
    out = capsys.readouterr()
    assert_no_key(caplog.text + out.out + out.err, "the log output")


async def check_route(client: Client, method: str, pattern: str, model: str) -> list[str]:
    """What is wrong with one route: a keyless or wrongly-keyed call let in, the right
    key refused, an exemption not listed, a key in a response."""
    url, (right, other) = concrete(pattern, model), keys_of(pattern)
    name, public = f"{method} {pattern}", pattern in PUBLIC
    failures = []
    status, text = await call(client, method, url, None)
    if public or pattern in FIRST_MESSAGE_AUTH:
        if status in (401, 403):
            failures.append(f"{name} is listed as open but refuses a keyless call ({status})")
    elif status != 401:
        failures.append(f"{name} without a key: {status}, not 401 (exempt? list it in PUBLIC with a reason)")
    for wrong in (f"Bearer {other}", f"Bearer {right[:-1]}", f"Basic {right}", "Bearer "):
        status, text = await call(client, method, url, wrong)
        if not public and status != 401:
            failures.append(f"{name} with {wrong.split()[0]} <wrong key>: {status}, not 401")
    status, text = await call(client, method, url, f"Bearer {right}")
    if status in (401, 403):
        failures.append(f"{name} refuses its own key ({status})")
    if API_KEY in text or ADMIN_KEY in text:
        failures.append(f"{name} shows a key in its answer")
    return failures


async def check_first_message_auth(client: Client) -> None:
    """The keyless websocket serves nothing until the first message holds the key."""
    for first in ({"type": "stats"}, {"type": "auth", "key": API_KEY}):
        async with client.ws_connect("/admin/ws") as ws:
            await ws.send_json(first)
            assert (await ws.receive_json(timeout=5))["type"] == "error"
            closing = await ws.receive(timeout=5)
            assert closing.type is WSMsgType.CLOSE and closing.data == aiohttp.WSCloseCode.POLICY_VIOLATION
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await client.ws_connect("/admin/ws", headers={"Authorization": f"Bearer {API_KEY}"})
    assert refused.value.status == 401


async def test_keys_are_compared_in_constant_time(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each key check goes through hmac.compare_digest: with `==` (or `in`, startswith...)
    the calls below would be let in or refused without one recorded comparison."""
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(plugins.bearer.hmac, "compare_digest", recording)
    async with serve_http(tiny_chat_folder, KEYS) as (_, client):
        calls = [("/v1/models", API_KEY, 200), ("/v1/models", "nope", 401),
                 ("/admin/stats", ADMIN_KEY, 200), ("/admin/stats", API_KEY, 401)]
        for path, key, want in calls:
            seen.clear()
            assert (await client.get(path, headers={"Authorization": f"Bearer {key}"})).status == want
            expected = ADMIN_KEY if path.startswith("/admin") else API_KEY
            assert seen == [(key.encode(), expected.encode())], path
        seen.clear()
        async with client.ws_connect("/admin/ws") as ws:  # the first-message key too
            await ws.send_json({"type": "auth", "key": ADMIN_KEY})
            assert (await ws.receive_json(timeout=5)) == {"type": "auth", "ok": True}
        assert seen == [(ADMIN_KEY.encode(), ADMIN_KEY.encode())]
