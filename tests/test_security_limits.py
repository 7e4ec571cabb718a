"""Security limits through the server (issue 14, item 4), beyond what
tests/test_http_errors.py (body size 413, `n`, `max_tokens`, prompt length vs context,
each refused while a good request generates undisturbed) and tests/test_route_security.py
(keys on every route, never logged or shown, compared in constant time) cover:

- `server.max_admin_clients`: one admin websocket more than the limit gets HTTP 429 with
  the admin error object before the upgrade, sockets still authenticating count, a
  generation meanwhile is undisturbed, and a slot freed is a slot usable again;
- storage keys are never derived from request text: prompts full of `../`, absolute
  paths and separators, sent through the file tier, leave only hex-named page files
  inside `hicache.storage_dir` and nothing anywhere else.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cache.storage.keys import KEY_HEX_LEN
from tests.inprocess import Client, serve_http

LIMIT = 2
GOOD = {"prompt": "A long story:", "max_tokens": 300, "temperature": 0, "ignore_eos": True}


async def assert_refused(http: Client, headers: dict[str, str] | None = None) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await http.ws_connect("/admin/ws", headers=headers)
    assert refused.value.status == 429, refused.value
    plain = await http.get("/admin/ws", headers={"Connection": "Upgrade", "Upgrade": "websocket",
                                                 "Sec-WebSocket-Version": "13",
                                                 "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", **(headers or {})})
    body = await plain.json()
    assert plain.status == 429 and plain.headers["Retry-After"] == "1", body
    assert body["type"] == "error" and "server.max_admin_clients" in body["message"], body


async def stats_reply(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    await ws.send_json({"type": "stats"})
    return dict(await ws.receive_json(timeout=10))


async def test_admin_websocket_clients_beyond_the_limit_get_429(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder, {"server.max_admin_clients": LIMIT}) as (_engine, http):
        alone = await (await http.post("/v1/completions", json=GOOD)).json()
        good = asyncio.ensure_future(http.post("/v1/completions", json=GOOD))
        sockets = [await http.ws_connect("/admin/ws") for _ in range(LIMIT)]
        for ws in sockets:
            assert (await stats_reply(ws))["type"] == "stats"
        await assert_refused(http)
        await sockets.pop().close()
        await asyncio.sleep(0.05)  # the server's handler returns and frees the slot
        sockets.append(await http.ws_connect("/admin/ws"))
        assert (await stats_reply(sockets[-1]))["type"] == "stats"
        for ws in sockets:  # the served ones were not disturbed by the refusals
            assert (await stats_reply(ws))["type"] == "stats"
            await ws.close()
        resp = await good
        assert resp.status == 200 and (await resp.json())["choices"] == alone["choices"]


async def test_sockets_waiting_to_authenticate_count(tiny_chat_folder: str) -> None:
    overrides = {"server.max_admin_clients": LIMIT, "server.admin_api_key": "adm-limit-key"}
    async with serve_http(tiny_chat_folder, overrides) as (_engine, http):
        pending = [await http.ws_connect("/admin/ws") for _ in range(LIMIT)]  # no key sent yet
        await assert_refused(http)
        await pending[0].send_json({"type": "auth", "key": "adm-limit-key"})
        assert await pending[0].receive_json(timeout=10) == {"type": "auth", "ok": True}
        for ws in pending:
            await ws.close()
        await asyncio.sleep(0.05)
        fresh = await http.ws_connect("/admin/ws", headers={"Authorization": "Bearer adm-limit-key"})
        assert (await stats_reply(fresh))["type"] == "stats"
        await fresh.close()


HOSTILE = ["../../../../etc/passwd " * 8, "/tmp/tierserve-owned/" * 10, "..\\..\\windows\\system32 " * 8,
           "kv/../../escape %2e%2e%2f " * 8, "~root/.ssh/authorized_keys " * 8]
PAGE_FILE = re.compile(rf"^[0-9a-f]{{2}}/[0-9a-f]{{{KEY_HEX_LEN}}}$")


async def test_storage_paths_never_come_from_request_text(tiny_chat_folder: str, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    overrides = {"cache.prefix": "radix", "cache.num_pages": 64, "hicache.host_pages": 128,
                 "hicache.storage": "file", "hicache.storage_dir": str(kv)}
    async with serve_http(tiny_chat_folder, overrides) as (engine, http):
        for text in HOSTILE:
            resp = await http.post("/v1/completions", json={"prompt": text, "max_tokens": 4})
            assert resp.status == 200, await resp.text()
            resp = await http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 4}})
            assert resp.status == 200, await resp.text()
        await engine.settle_copies()
        storage = engine.storage
        assert storage is not None
        for _ in range(200):
            if not storage.stats()["queued_bytes"]:
                break
            await asyncio.sleep(0.05)
        assert storage.stats()["written_pages"] >= 5 * 8, storage.stats()
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files and all(f.startswith("kv/") for f in files), files  # nothing outside the tier's folder
    pages = [f[3:] for f in files if not Path(f).name.startswith(".")]
    assert all(PAGE_FILE.match(p) for p in pages), [p for p in pages if not PAGE_FILE.match(p)]
    assert not Path("/tmp/tierserve-owned").exists()
