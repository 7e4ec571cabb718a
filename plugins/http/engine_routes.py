"""Routes that need the engine (admin socket, metrics), mounted before it exists.

The server binds its port before the model loads so that /health can answer "starting";
aiohttp freezes the router at start-up, so these routes are mounted as one dispatcher
and bound to an inner application once the engine is ready. Until then they answer 503.
"""

from __future__ import annotations

from aiohttp import web

from kernel.async_engine import AsyncEngine
from plugins.admin import add_admin_routes
from plugins.http.errors import APIError
from plugins.metrics import add_metrics_route

PATHS = ("/metrics", "/admin", "/admin/{tail:.*}")


class EngineRoutes:
    def __init__(self) -> None:
        self.inner: web.Application | None = None

    def mount(self, app: web.Application) -> None:
        for path in PATHS:
            app.router.add_route("*", path, self.dispatch)
        app.on_shutdown.append(self._shutdown)
        app.on_cleanup.append(self._cleanup)

    def bind(self, engine: AsyncEngine) -> None:
        inner = web.Application()
        add_admin_routes(inner, engine)
        add_metrics_route(inner, engine)
        inner.freeze()
        self.inner = inner

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        if self.inner is None:
            raise APIError(503, "the engine is still starting", code="starting")
        match = await self.inner.router.resolve(request)
        if match.http_exception is not None:
            raise match.http_exception
        return await match.handler(request)

    async def _shutdown(self, _: web.Application) -> None:
        if self.inner is not None:
            await self.inner.shutdown()

    async def _cleanup(self, _: web.Application) -> None:
        if self.inner is not None:
            await self.inner.cleanup()


ENGINE_ROUTES = web.AppKey("engine_routes", EngineRoutes)
