"""An AsyncEngine on the tiny model behind an in-process aiohttp test server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kernel.async_engine import AsyncEngine
from tests.conftest import TINY_OVERRIDES

Client = TestClient[web.Request, web.Application]


@asynccontextmanager
async def serve_engine(
    folder: str,
    mount: Callable[[web.Application, AsyncEngine], None],
    overrides: dict[str, Any] | None = None,
    middlewares: tuple[Any, ...] = (),
) -> AsyncIterator[tuple[AsyncEngine, Client]]:
    """Build the engine (radix cache on), let `mount` add routes, serve until exit."""
    config = {"model.path": folder, **TINY_OVERRIDES, "cache.prefix": "radix", **(overrides or {})}
    engine = await AsyncEngine.create(None, config)
    app = web.Application(middlewares=middlewares)
    mount(app, engine)
    client: Client = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield engine, client
    finally:
        await client.close()
        await engine.shutdown()
