"""Admin API: a websocket at `GET /admin/ws` plus a few plain HTTP routes.

Access
------
With `server.admin_api_key` set: send `Authorization: Bearer <key>` on the upgrade
request, or (browsers cannot set that header) make the first message
`{"type": "auth", "key": "<key>"}` within 10 s; the reply is `{"type": "auth", "ok": true}`.
A wrong header gets HTTP 401 before the upgrade; a wrong or missing first message gets
`{"type": "error", ...}` and close code 1008. Without a key, only loopback clients are
served (others: HTTP 403), and a browser `Origin` must be loopback too. At most
`server.max_admin_clients` sockets are open at once (counted from the upgrade); one
more gets HTTP 429 with an error object and `Retry-After: 1`, before the upgrade.

Protocol
--------
Every message, both ways, is a JSON text frame holding an object with a string
`type`; a reply has the type of the message it answers and echoes its `id` field if it
had one. Problems (malformed JSON, unknown type, bad arguments, a failing command) are
answered with `{"type": "error", "message": "..."}`; the socket stays open.

- `{"type": "snapshot"}` → `{"type": "snapshot", "page_size", "nodes": [...]}`: one
  object per radix-tree node, root first: `id`, `parent`, `num_tokens`, `num_pages`,
  `lock_ref`, `hit_count`, `last_access` (the tree's logical clock), `priority`, `tier`,
  `namespace`, `state_slot`, `state_len`, `num_host_pages`, `stored` (its pages are in
  the storage tier). Empty with `cache.prefix: none`.
- `{"type": "snapshot", "limit": N, "by": "hits" | "tokens"}` (summarized, for big
  trees; `by` defaults to "hits") → the same plus `total_nodes`, `truncated`, `by` and
  `summary` {nodes, tokens, tiers {device, device+host, host: {nodes, tokens}}, stored
  {nodes, tokens}, locked, with_state} (over every node but the root); `nodes` holds at
  most N: all when they fit, else the root and the N - 1 others ranked highest by hit
  count (then tokens) or by tokens (then hits), in tree order.
- `{"type": "stats"}` → `engine.stats()` as it is: `pages` {usable, free, cached,
  evictable, held}, `requests` {waiting, running}, `idle`, `counters` {steps,
  prompt_tokens, generation_tokens}, `cache` (prefix query/hit tokens, cached/evictable
  pages), `num_retractions`, `speculative` (drafted / accepted tokens, verify steps, the
  adaptive rule's state; null without speculation), `audit` (the online audit's counts
  per tier and last mismatch; null while audit.sample_rate is 0), `policies` {schedule, evict},
  `halt_reason` (null while the step loop runs).
- `{"type": "flush"}` → `{"type": "flush", "ok", "reason"}`: empties the prefix cache;
  refused (ok false) while requests are in flight.
- `{"type": "set_policy", "kind": "evict" | "schedule", "name": "lru"}` → `{"type":
  "set_policy", "ok": true, "kind", "name"}`; takes effect from the next step. Only
  registered names; an unknown one gets an error listing the known ones.
- `{"type": "policies"}` → `{"type": "policies", "current": {"schedule", "evict"},
  "known": {"schedule": [...], "evict": [...]}}`: the registered names `set_policy`
  accepts, per kind.
- `{"type": "storage", "enable": true | false}` → `{"type": "storage", "ok": true,
  "enabled"}`: switches the storage tier back on after it switched itself off for
  failing (or off by hand); without `enable` it only reports. An error without one.
- `{"type": "check"}` → `{"type": "check", "ok": true}` or `{"ok": false, "message"}`:
  runs the engine's integrity check (scheduler and tree) now.
- `{"type": "subscribe"}` → `{"type": "subscribe", "ok": true}`, then pushes:
  `{"type": "kv_event", "event": "BlockStored", "block_hashes", "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium"}`, `{"type": "kv_event", "event":
  "BlockRemoved", "block_hashes", "medium"}`, `{"type": "kv_event", "event":
  "AllBlocksCleared"}`, and for hybrid models `{"type": "kv_event", "event": "StateStored",
  "block_hash", "num_tokens"}` / `{"type": "kv_event", "event": "StateRemoved", "block_hash"}`
  (hashes are unsigned 64-bit integers, see cache/kv_events.py;
  JavaScript clients must parse them as BigInt), and `{"type": "request_event", "kind":
  "queued" | "admitted" | "retracted" | "tokens" | "finished", "rid", "time"
  (monotonic seconds), ...}` with `prompt_tokens` (queued), `cached_tokens` (admitted),
  `count` and `first` (tokens), `reason`, `prompt_tokens`, `completion_tokens`,
  `cached_tokens` (finished). To follow the tree: subscribe, then ask for a snapshot and
  apply the events that arrive after its reply.
- `{"type": "unsubscribe"}` → `{"type": "unsubscribe", "ok": true, "was_subscribed"}`;
  no event follows this reply.

Replies and events share one bounded send queue per connection (1024 by default). A
client that falls that far behind is dropped, with close code 1013 and the reason,
instead of slowing the engine down.

The inspector page (plugins/admin/page.py, static/) is served at `GET /admin/` to anyone:
it holds no data, and asks for the key to open this socket.

Plain HTTP (same access rules, bearer header only): `GET /admin/snapshot`,
`GET /admin/stats`, `GET /admin/check`, `POST /admin/flush`, `POST /admin/set_policy`
(JSON body `{"kind", "name"}`) answer with the same objects as the socket.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from kernel.async_engine import AsyncEngine
from plugins.admin.auth import Verdict, judge, refusal
from plugins.admin.messages import COMMANDS, Command, Message, ProtocolError
from plugins.admin.page import add_page_routes
from plugins.admin.session import AdminSession, close_socket, parse
from plugins.bearer import key_matches
from plugins.jsonio import JSONBodyError, decode_object, json_response

AUTH_TIMEOUT_S = 10.0
DEFAULT_QUEUE_SIZE = 1024
READ_ROUTES = ("snapshot", "stats", "check")
WRITE_ROUTES = ("flush", "set_policy")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_admin_routes(app: web.Application, engine: AsyncEngine, *, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
    """Mount the admin websocket, the plain routes and the inspector page on `app`."""
    admin = AdminRoutes(engine, queue_size)
    add_page_routes(app)
    app.router.add_get("/admin/ws", admin.websocket)
    for name in READ_ROUTES:
        app.router.add_get(f"/admin/{name}", admin.plain(COMMANDS[name]))
    for name in WRITE_ROUTES:
        app.router.add_post(f"/admin/{name}", admin.plain(COMMANDS[name]))
    app.on_shutdown.append(admin.close_all)


class AdminRoutes:
    def __init__(self, engine: AsyncEngine, queue_size: int) -> None:
        if queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        self.engine = engine
        self.queue_size = queue_size
        self.key = engine.config.server.admin_api_key
        self.max_clients = engine.config.server.max_admin_clients
        self._sockets: weakref.WeakSet[web.WebSocketResponse] = weakref.WeakSet()
        self._open = 0  # upgraded sockets, still authenticating or served

    async def websocket(self, request: web.Request) -> web.StreamResponse:
        verdict = judge(request, self.key)
        if verdict in (Verdict.BAD_KEY, Verdict.FORBIDDEN):
            return refusal(verdict)
        # NOTE: counted from the upgrade, not from the auth: sockets that never send
        # their key hold a slot for up to AUTH_TIMEOUT_S, and they count too.
        if self._open >= self.max_clients:
            return too_many_clients(self.max_clients)
        self._open += 1
        try:
            ws = web.WebSocketResponse(heartbeat=30.0, compress=False, timeout=5.0, max_msg_size=1 << 16)
            await ws.prepare(request)
            if verdict is Verdict.NEEDS_KEY and not await self._authenticate(ws):
                return ws
            await self._serve(ws)
            return ws
        finally:
            self._open -= 1

    async def _authenticate(self, ws: web.WebSocketResponse) -> bool:
        """First-message auth; refuses (error message, close 1008) on anything but the key."""
        if await self._first_message_has_key(ws):
            await ws.send_str(orjson.dumps({"type": "auth", "ok": True}).decode())
            return True
        if not ws.closed:
            refused = {"type": "error", "message": "unauthorized: send {\"type\": \"auth\", \"key\": ...} first"}
            await ws.send_str(orjson.dumps(refused).decode())
            await close_socket(ws, WSCloseCode.POLICY_VIOLATION, "unauthorized")
        return False

    async def _first_message_has_key(self, ws: web.WebSocketResponse) -> bool:
        try:
            msg = await ws.receive(timeout=AUTH_TIMEOUT_S)
            first = parse(msg.data) if msg.type is WSMsgType.TEXT else {}
        except (TimeoutError, ProtocolError):
            return False
        return first.get("type") == "auth" and self.key is not None and key_matches(first.get("key"), self.key)

    async def _serve(self, ws: web.WebSocketResponse) -> None:
        session = AdminSession(ws, self.engine, self.queue_size)
        self._sockets.add(ws)
        try:
            async for msg in ws:
                if msg.type is WSMsgType.TEXT:
                    session.handle(msg.data)
                elif msg.type is WSMsgType.BINARY:
                    session.outbox.put({"type": "error", "message": "binary frames are not supported"})
        finally:
            self._sockets.discard(ws)
            await session.close()

    def plain(self, command: Command) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            verdict = judge(request, self.key)
            if verdict is not Verdict.ALLOWED:
                return refusal(Verdict.BAD_KEY if verdict is Verdict.NEEDS_KEY else verdict)
            try:
                reply = command(self.engine, await request_body(request))
            except ProtocolError as exc:
                return json_response({"type": "error", "message": str(exc)}, status=400)
            return json_response(reply)

        return handler

    async def close_all(self, app: web.Application) -> None:
        # Together: each unresponsive client may take the whole close timeout.
        await asyncio.gather(*(close_socket(ws, WSCloseCode.GOING_AWAY, "server shutdown") for ws in self._sockets))


def too_many_clients(limit: int) -> web.Response:
    """HTTP 429 before the upgrade: `server.max_admin_clients` sockets are open already."""
    message = f"admin API: {limit} admin websocket clients are connected already (server.max_admin_clients)"
    return json_response({"type": "error", "message": message}, status=429, headers={"Retry-After": "1"})


async def request_body(request: web.Request) -> Message:
    if not request.can_read_body:
        return {}
    try:
        return decode_object(await request.read())
    except JSONBodyError as exc:
        raise ProtocolError(f"the body: {exc}") from None
