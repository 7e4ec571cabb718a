"""Server-sent events: `data: <json>` lines, ended by `data: [DONE]`."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


class EventStream:
    """One SSE response. Open it only after validation, so errors keep their status."""

    def __init__(self) -> None:
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

    async def open(self, request: web.Request) -> EventStream:
        await self.response.prepare(request)
        return self

    async def send(self, obj: Any) -> None:
        # A write to a closed connection raises ConnectionResetError: the handler's
        # clean-up then aborts the generation.
        await self.response.write(b"data: " + orjson.dumps(obj) + b"\n\n")

    async def finish(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response

