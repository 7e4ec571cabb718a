"""Two ways a request ends early while steps run: its consumer leaves the stream, or it is
aborted from outside while a consumer waits for it."""

from __future__ import annotations

import asyncio
from typing import Any

from kernel.async_engine import AsyncEngine


async def leave_and_abort(engine: AsyncEngine, cut: str, outside: str, after: int = 6) -> dict[str, Any]:
    """Leave `cut`'s stream once it has `after` tokens (that aborts it), then abort `outside`
    while a consumer waits for it; returns what that consumer got."""
    consumer = asyncio.create_task(engine.collect(outside))
    seen = 0
    async for chunk in engine.stream(cut):
        seen += len(chunk.token_ids)
        if seen >= after:
            break  # leaving the stream aborts the request
    engine.abort(outside)
    return await asyncio.wait_for(consumer, timeout=30)


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        if engine.is_idle():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine never went idle after the aborts")
