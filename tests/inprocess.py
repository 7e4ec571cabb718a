"""An AsyncEngine on the tiny model behind an in-process aiohttp test server: with the
routes a test mounts (`serve_engine`), or the whole HTTP app of `tierserve serve`
(`serve_http`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kernel.async_engine import AsyncEngine
from kernel.config import load_config
from plugins.http.server import ENGINE_ROUTES, build_app
from plugins.http.state import ServerState
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
    async with _serving(app, engine) as client:
        yield engine, client


@asynccontextmanager
async def serve_http(folder: str, overrides: dict[str, Any] | None = None) -> AsyncIterator[tuple[AsyncEngine, Client]]:
    """The server's own app (`build_app`: middlewares, every route, admin and metrics
    bound) over an in-process engine, so a test can also reach the engine itself."""
    config = load_config(None, {"model.path": folder, **TINY_OVERRIDES, **(overrides or {})})
    engine = await AsyncEngine.create(config)
    app = build_app(ServerState(config, engine=engine))
    app[ENGINE_ROUTES].bind(engine)
    async with _serving(app, engine) as client:
        yield engine, client


@asynccontextmanager
async def _serving(app: web.Application, engine: AsyncEngine) -> AsyncIterator[Client]:
    """A test client on `app`; on exit the client closes, then the engine shuts down."""
    client: Client = TestClient(TestServer(app))
    try:
        await client.start_server()
        yield client
    finally:
        await client.close()
        await engine.shutdown()


def record_seeds(engine: AsyncEngine, monkeypatch: Any) -> list[int | None]:
    """The sampling seed of every request the server submits to `engine` from now on
    (what ran, for tests of `n` choices: each its own seed, whatever tokens come out)."""
    seeds: list[int | None] = []
    add_request = engine.add_request

    def spy(prompt: Any, params: Any, *args: Any, **kwargs: Any) -> str:
        seeds.append(params.seed)
        return add_request(prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    return seeds
