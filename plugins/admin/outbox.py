"""One connection's bounded send queue and the task that drains it to the socket.

Everything a connection sends (replies and pushed events) goes through here, so the
client sees them in order: after the `unsubscribe` reply, no event follows. Producers
are synchronous callbacks inside engine and cache operations, so `put` never waits:
when the queue is full the client is too slow, and it is dropped (`on_overflow`)
rather than ever slowing the engine down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog

log = structlog.get_logger("tierserve.admin")

Encode = Callable[[Any], dict[str, Any]]
Send = Callable[[str], Awaitable[None]]


class Outbox:
    def __init__(self, send: Send, encode: Encode, maxsize: int, on_overflow: Callable[[str], None]) -> None:
        self._send = send
        self._encode = encode  # runs in the writer, not in the producers' callbacks
        self._on_overflow = on_overflow
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize)
        self._writer = asyncio.get_running_loop().create_task(self._drain())
        self.closed = False

    def put(self, item: Any) -> None:
        """Queue `item` (a reply dict or a raw event) without waiting; overflow drops the client."""
        if self.closed:
            return
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self.close()
            self._on_overflow(f"send queue overflow ({self._queue.maxsize} messages): client reads too slowly")

    def close(self) -> None:
        """Stop sending; queued items are discarded."""
        self.closed = True
        self._writer.cancel()

    async def _drain(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                text = orjson.dumps(self._encode(item)).decode()
            except (TypeError, orjson.JSONEncodeError):
                log.exception("admin_encode_failed", item=repr(item)[:200])
                continue
            try:
                await self._send(text)
            except ConnectionError:
                return  # the socket is gone; the connection handler cleans up
