"""Admin websocket and routes, in-process: a tiny engine behind aiohttp's test server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestClient

from cache.kv_events import chain_hashes, page_hashes
from kernel.async_engine import AsyncEngine
from plugins.admin import add_admin_routes
from plugins.admin.auth import is_loopback, origin_is_local
from plugins.admin.outbox import Outbox
from tests.conftest import TINY_OVERRIDES
from tests.inprocess import serve_engine

PAGE = int(TINY_OVERRIDES["cache.page_size"])  # type: ignore[call-overload]
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
PROMPT_A = list(range(100, 130))  # 30 tokens: 7 whole pages of 4
PROMPT_B = PROMPT_A[:12] + list(range(300, 314))  # shares 3 pages with A
KEY = "s3cret-admin"
Admin = tuple[AsyncEngine, TestClient[web.Request, web.Application]]


@asynccontextmanager
async def serve(
    folder: str, overrides: dict[str, Any] | None = None, *, queue_size: int = 1024,
    middlewares: tuple[Any, ...] = (),
) -> AsyncIterator[Admin]:
    def mount(app: web.Application, engine: AsyncEngine) -> None:
        add_admin_routes(app, engine, queue_size=queue_size)

    async with serve_engine(folder, mount, overrides, middlewares) as served:
        yield served


async def ask(ws: aiohttp.ClientWebSocketResponse, msg: dict[str, Any]) -> dict[str, Any]:
    """Send `msg` and return the next reply that is not a pushed event."""
    await ws.send_json(msg)
    while True:
        reply: dict[str, Any] = await ws.receive_json(timeout=5)
        if reply["type"] not in ("kv_event", "request_event"):
            return reply


async def collect_until(
    ws: aiohttp.ClientWebSocketResponse, done: Callable[[dict[str, Any]], bool]
) -> list[dict[str, Any]]:
    """Pushed messages up to and including the first for which `done` holds."""
    seen: list[dict[str, Any]] = []
    while not seen or not done(seen[-1]):
        seen.append(await ws.receive_json(timeout=5))
    return seen


def is_finish_of(rid: str) -> Callable[[dict[str, Any]], bool]:
    return lambda m: m["type"] == "request_event" and m["kind"] == "finished" and m["rid"] == rid


def stored_hashes(messages: list[dict[str, Any]]) -> list[int]:
    return [h for m in messages if m.get("event") == "BlockStored" for h in m["block_hashes"]]


async def test_subscribe_streams_block_hashes_and_request_events(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder) as (engine, client), client.ws_connect("/admin/ws") as ws:
        assert await ask(ws, {"type": "subscribe"}) == {"type": "subscribe", "ok": True}
        rid = engine.add_request(PROMPT_A, GREEDY)
        out = await engine.collect(rid)
        seen = await collect_until(ws, is_finish_of(rid))
        kinds = [m["kind"] for m in seen if m["type"] == "request_event"]
        assert kinds[:3] == ["queued", "admitted", "tokens"] and kinds[-1] == "finished"
        assert seen[-1]["reason"] == "length" and seen[-1]["prompt_tokens"] == len(PROMPT_A)
        # Hashes a router recomputes from tokens alone: the prompt's pages come first.
        stored = stored_hashes(seen)
        prompt_pages = page_hashes(PROMPT_A, PAGE)
        assert stored[: len(prompt_pages)] == prompt_pages
        assert stored == page_hashes(PROMPT_A + out["output_ids"], PAGE)[: len(stored)]
        first = next(m for m in seen if m.get("event") == "BlockStored")
        assert first["parent_block_hash"] is None and first["block_size"] == PAGE

        rid = engine.add_request(PROMPT_B, GREEDY)
        await engine.collect(rid)
        seen = await collect_until(ws, is_finish_of(rid))
        new = next(m for m in seen if m.get("event") == "BlockStored")
        # B's first three pages were cached by A: its new pages hang below them.
        assert new["parent_block_hash"] == prompt_pages[2]
        assert new["block_hashes"] == chain_hashes(prompt_pages[2], new["token_ids"], PAGE)
        assert stored_hashes(seen)[:3] == page_hashes(PROMPT_B, PAGE)[3:]

        assert (await ask(ws, {"type": "unsubscribe"}))["was_subscribed"] is True
        await engine.generate(PROMPT_A[:9], GREEDY)
        await ws.send_json({"type": "stats"})
        assert (await ws.receive_json(timeout=5))["type"] == "stats"  # nothing pushed in between


async def test_snapshot_stats_check_flush(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder) as (engine, client), client.ws_connect("/admin/ws") as ws:
        await engine.generate(PROMPT_A, GREEDY)
        await engine.generate(PROMPT_B, GREEDY)
        snap = await ask(ws, {"type": "snapshot"})
        stats = await ask(ws, {"type": "stats"})
        nodes = snap["nodes"]
        cached = stats["pages"]["cached"]
        assert len(nodes) > 2 and nodes[0]["parent"] is None  # root, then the split branches
        assert sum(n["num_pages"] for n in nodes) == cached > 0
        assert all(n["num_tokens"] == n["num_pages"] * PAGE and n["lock_ref"] == 0 for n in nodes)
        assert {n["tier"] for n in nodes} == {"device"}
        assert stats["counters"]["prompt_tokens"] == len(PROMPT_A) + len(PROMPT_B)
        assert stats["requests"] == {"waiting": 0, "running": 0} and stats["idle"] is True
        assert stats["pages"]["free"] + cached == stats["pages"]["usable"]
        assert stats["cache"]["prefix_hit_tokens"] == 12
        assert await ask(ws, {"type": "check"}) == {"type": "check", "ok": True}

        # Long enough that the flush surely arrives while it still runs.
        rid = engine.add_request(PROMPT_A, {**GREEDY, "max_new_tokens": 64})
        busy = await ask(ws, {"type": "flush"})
        assert busy["ok"] is False and "in flight" in busy["reason"]
        await engine.collect(rid)
        assert await ask(ws, {"type": "flush"}) == {"type": "flush", "ok": True, "reason": "flushed"}
        assert (await ask(ws, {"type": "snapshot"}))["nodes"] == [nodes[0]]  # the root alone

        plain = await client.get("/admin/stats")
        assert plain.status == 200 and (await plain.json())["pages"]["cached"] == 0


async def test_set_policy_switches_and_rejects_unknown(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder) as (engine, client), client.ws_connect("/admin/ws") as ws:
        reply = await ask(ws, {"type": "set_policy", "kind": "evict", "name": "lfu"})
        assert reply == {"type": "set_policy", "ok": True, "kind": "evict", "name": "lfu"}
        await ask(ws, {"type": "set_policy", "kind": "schedule", "name": "lpm"})
        assert (await ask(ws, {"type": "stats"}))["policies"] == {"schedule": "lpm", "evict": "lfu"}
        assert engine.policies() == {"schedule": "lpm", "evict": "lfu"}
        await engine.generate(PROMPT_A, GREEDY)  # still serves after the switch

        bad = await ask(ws, {"type": "set_policy", "kind": "evict", "name": "mru"})
        assert bad["type"] == "error" and "'lru'" in bad["message"]
        dotted = await ask(ws, {"type": "set_policy", "kind": "schedule", "name": "os:system"})
        assert dotted["type"] == "error"
        assert (await ask(ws, {"type": "set_policy", "kind": "tier"}))["type"] == "error"
        posted = await client.post("/admin/set_policy", json={"kind": "evict", "name": "fifo"})
        assert posted.status == 200 and (await posted.json())["name"] == "fifo"


async def test_errors_leave_the_socket_usable(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder) as (_, client), client.ws_connect("/admin/ws") as ws:
        unknown = await ask(ws, {"type": "reboot", "id": 7})
        assert unknown["type"] == "error" and "snapshot" in unknown["message"] and unknown["id"] == 7
        await ws.send_str("{not json")
        assert (await ws.receive_json(timeout=5))["message"].startswith("malformed JSON")
        await ws.send_str("[1, 2]")
        assert (await ws.receive_json(timeout=5))["type"] == "error"
        await ws.send_bytes(b"\x00")
        assert (await ws.receive_json(timeout=5))["type"] == "error"
        assert (await ask(ws, {"type": "check", "id": "c1"})) == {"type": "check", "ok": True, "id": "c1"}


async def test_prefix_none_has_an_empty_snapshot(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder, {"cache.prefix": "none"}) as (engine, client):
        ws = await client.ws_connect("/admin/ws")  # the client closes it on exit
        await ask(ws, {"type": "subscribe"})
        await engine.generate(PROMPT_A, GREEDY)
        assert (await ask(ws, {"type": "snapshot"}))["nodes"] == []
        assert (await ask(ws, {"type": "set_policy", "kind": "evict", "name": "lru"}))["type"] == "error"
        assert (await ask(ws, {"type": "stats"}))["policies"]["evict"] is None


async def test_admin_key_is_required(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder, {"server.admin_api_key": KEY}) as (_, client):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect("/admin/ws", headers={"Authorization": "Bearer wrong"})
        assert refused.value.status == 401
        async with client.ws_connect("/admin/ws", headers={"Authorization": f"Bearer {KEY}"}) as ws:
            assert (await ask(ws, {"type": "check"}))["ok"] is True
        async with client.ws_connect("/admin/ws") as ws:  # first-message auth
            assert await ask(ws, {"type": "auth", "key": KEY}) == {"type": "auth", "ok": True}
            assert (await ask(ws, {"type": "stats"}))["type"] == "stats"
        async with client.ws_connect("/admin/ws") as ws:
            await ws.send_json({"type": "stats"})  # anything but the key first
            assert (await ws.receive_json(timeout=5))["type"] == "error"
            closing = await ws.receive(timeout=5)
            assert closing.type is WSMsgType.CLOSE and closing.data == aiohttp.WSCloseCode.POLICY_VIOLATION
        assert (await client.get("/admin/stats")).status == 401
        ok = await client.get("/admin/stats", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status == 200


@web.middleware
async def from_far_away(request: web.Request, handler: Any) -> web.StreamResponse:
    response: web.StreamResponse = await handler(request.clone(remote="203.0.113.7"))
    return response


async def test_without_a_key_only_local_clients(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder) as (_, client):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect("/admin/ws", headers={"Origin": "http://evil.example"})
        assert refused.value.status == 403
        assert (await client.post("/admin/flush", headers={"Origin": "https://evil.example"})).status == 403
        local = await client.post("/admin/flush", headers={"Origin": "http://localhost:3000"})
        assert local.status == 200
    async with serve(tiny_chat_folder, middlewares=(from_far_away,)) as (_, client):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect("/admin/ws")
        assert refused.value.status == 403


def test_loopback_and_origin_rules() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("127.3.0.1")
    assert not is_loopback("10.0.0.1") and not is_loopback(None) and not is_loopback("")
    assert origin_is_local(None) and origin_is_local("http://[::1]:8080")
    assert not origin_is_local("http://localhost.evil.example") and not origin_is_local("null")


async def test_slow_subscriber_is_dropped_without_stalling(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder, queue_size=4) as (engine, client), client.ws_connect("/admin/ws") as ws:
        await ask(ws, {"type": "subscribe"})
        # Eight requests queued in one go publish faster than any writer can send.
        rids = [engine.add_request(PROMPT_A[i:], GREEDY) for i in range(8)]
        outs = await asyncio.wait_for(asyncio.gather(*(engine.collect(r) for r in rids)), 10)
        assert all(o["meta_info"]["finish_reason"] == "length" for o in outs)
        assert not engine.events.active  # the dropped feed let go of the engine
        while (msg := await ws.receive(timeout=5)).type is WSMsgType.TEXT:
            pass
        assert msg.type is WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.TRY_AGAIN_LATER
        assert "overflow" in str(msg.extra)


async def test_outbox_never_waits_on_a_stuck_socket() -> None:
    stuck = asyncio.Event()
    dropped: list[str] = []

    async def send(text: str) -> None:
        await stuck.wait()  # a client that never reads

    outbox = Outbox(send, lambda item: {"n": item}, 2, dropped.append)
    for n in range(10):
        outbox.put(n)  # synchronous: must return at once even when full
        await asyncio.sleep(0)
    assert len(dropped) == 1 and outbox.closed
