"""One authenticated admin websocket connection: parse, dispatch, reply, subscribe."""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import WSCloseCode, web

from kernel.async_engine import AsyncEngine
from plugins.admin.feed import EventFeed
from plugins.admin.messages import COMMANDS, Message, ProtocolError, encode_outgoing
from plugins.admin.outbox import Outbox
from plugins.jsonio import JSONBodyError, decode_object

log = structlog.get_logger("tierserve.admin")

SESSION_TYPES = ("auth", "subscribe", "unsubscribe")
KNOWN_TYPES = sorted([*SESSION_TYPES, *COMMANDS])
CLOSE_TIMEOUT_S = 5.0


class AdminSession:
    def __init__(self, ws: web.WebSocketResponse, engine: AsyncEngine, queue_size: int) -> None:
        self.ws = ws
        self.engine = engine
        self.outbox = Outbox(ws.send_str, encode_outgoing, queue_size, self._drop)
        self.feed: EventFeed | None = None
        self._closer: asyncio.Task[None] | None = None

    def handle(self, text: str) -> None:
        """Answer one client message; any problem becomes an error reply, never a close."""
        msg: Message = {}
        try:
            msg = parse(text)
            reply = self._dispatch(msg)
        except ProtocolError as exc:
            reply = {"type": "error", "message": str(exc)}
        except Exception as exc:  # a failed admin command must not kill the socket
            log.exception("admin_command_failed", type=msg.get("type"))
            reply = {"type": "error", "message": f"{msg.get('type')} failed: {exc}"}
        if "id" in msg:
            reply["id"] = msg["id"]  # lets a client match replies to requests
        self.outbox.put(reply)

    def _dispatch(self, msg: Message) -> Message:
        kind = msg["type"]
        if kind == "subscribe":
            return self._subscribe()
        if kind == "unsubscribe":
            return self._unsubscribe()
        if kind == "auth":
            return {"type": "auth", "ok": True}  # already authenticated
        command = COMMANDS.get(kind)
        if command is None:
            raise ProtocolError(f"unknown message type {kind!r}; known: {KNOWN_TYPES}")
        return command(self.engine, msg)

    def _subscribe(self) -> Message:
        if self.feed is None:
            self.feed = EventFeed(self.engine, self.outbox.put)
        return {"type": "subscribe", "ok": True}

    def _unsubscribe(self) -> Message:
        was = self.feed is not None
        self._detach()
        return {"type": "unsubscribe", "ok": True, "was_subscribed": was}

    def _detach(self) -> None:
        if self.feed is not None:
            self.feed.close()
            self.feed = None

    def _drop(self, reason: str) -> None:
        """Called from inside an engine callback: detach now, close the socket later."""
        log.warning("admin_subscriber_dropped", reason=reason)
        self._detach()
        if self._closer is None:
            self._closer = asyncio.get_running_loop().create_task(
                close_socket(self.ws, WSCloseCode.TRY_AGAIN_LATER, reason)
            )

    async def close(self) -> None:
        self._detach()
        self.outbox.close()
        if self._closer is not None:
            await self._closer


def parse(text: str) -> Message:
    try:
        msg = decode_object(text)
    except JSONBodyError as exc:
        raise ProtocolError(f"{exc} (each message is an object with a string \"type\")") from None
    if not isinstance(msg.get("type"), str):
        raise ProtocolError('each message must be a JSON object with a string "type"')
    return msg


async def close_socket(ws: web.WebSocketResponse, code: int, reason: str) -> None:
    """Close with a reason (trimmed to the 123 bytes a close frame allows), and give up
    on a client that does not answer: one that stopped reading may never drain."""
    try:
        await asyncio.wait_for(ws.close(code=code, message=reason.encode()[:123]), CLOSE_TIMEOUT_S)
    except (TimeoutError, ConnectionError):
        pass
