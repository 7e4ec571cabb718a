"""What the handlers share: the config, the engine once loaded, and live generations."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web

from kernel.async_engine import AsyncEngine
from kernel.config import Config
from kernel.sampling_params import SamplingParams
from plugins.http.errors import APIError, halted
from plugins.http.protocol import Prompt
from plugins.http.submission import Submission, submit


@dataclass
class ServerState:
    config: Config
    engine: AsyncEngine | None = None
    draining: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))
    live: set[Submission] = field(default_factory=set)

    def require_engine(self) -> AsyncEngine:
        """The engine, or 503 while it loads, once it has halted, or while the server drains."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="draining")
        if self.engine is None:
            raise APIError(503, "the server is starting; the model is still loading", code="starting")
        if self.engine.halt_reason is not None:
            raise halted(self.engine.halt_reason)
        return self.engine

    @asynccontextmanager
    async def generation(
        self, requests: Sequence[tuple[Prompt, SamplingParams]], names: Mapping[str, str],
    ) -> AsyncIterator[Submission]:
        """Queue `requests` (all or none); on exit, whatever still runs is aborted."""
        engine = self.require_engine()
        sub = await submit(engine, requests, names, self.config.server.max_queued_requests)
        self.live.add(sub)
        try:
            yield sub
        finally:
            self.live.discard(sub)
            await sub.close()


STATE = web.AppKey("state", ServerState)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]
