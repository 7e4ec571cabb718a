"""The HTTP server's life: bind, load the engine, serve, drain on SIGTERM/SIGINT, exit 0.

The port is bound before the model loads, so /health can say 503 "starting" instead of
refusing connections. On a signal the server keeps listening but answers 503 to new
work, lets in-flight generations finish for up to `server.drain_grace_s`, aborts the rest,
then closes connections and the engine.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import structlog
import uvloop
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.typedefs import Middleware

from kernel.async_engine import AsyncEngine
from kernel.config import Config
from kernel.results.events import log_lifecycle
from plugins.http import native_api, openai_api, openapi, worker_api
from plugins.http.auth import auth_middleware
from plugins.http.engine_routes import ENGINE_ROUTES, EngineRoutes
from plugins.http.errors import error_middleware
from plugins.http.protocol import MAX_BODY_BYTES
from plugins.http.state import STATE, ServerState
from plugins.kv_events_zmq import start_kv_events

log = structlog.get_logger("tierserve")

ABORT_WAIT_S = 5.0  # then aborted ones get this long to send their last bytes


def build_app(state: ServerState) -> web.Application:
    middlewares: list[Middleware] = [error_middleware]
    if state.config.server.api_key:
        middlewares.append(auth_middleware(state.config.server.api_key))
    # client_max_size bounds bodies sent without Content-Length (chunked) as well.
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    openai_api.add_routes(app)
    native_api.add_routes(app)
    worker_api.add_routes(app)
    openapi.add_routes(app)
    routes = EngineRoutes()
    routes.mount(app)
    app[ENGINE_ROUTES] = routes
    return app


def run_server(config: Config) -> int:
    """Serve until SIGTERM/SIGINT; the exit status (0 after a clean drain)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(serve(config))


class Http2Probe(logging.Filter):
    """Routers probe a worker for gRPC first (an HTTP/2 preface, `PRI * HTTP/2.0`); aiohttp
    answers 400 and would log a traceback per probe. The probe is expected: its record is
    dropped (sglang-router does this at every worker it registers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI" in str(exc))


async def serve(config: Config) -> int:
    logging.getLogger("aiohttp.server").addFilter(Http2Probe())
    state = ServerState(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, state, stop, sig)
    # handler_cancellation: a client that disconnects cancels its handler, which
    # aborts its generation (see submission.py) instead of computing for nobody.
    app = build_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=ABORT_WAIT_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.server.host, config.server.port).start()
        state.engine = await AsyncEngine.create(config)
        app[ENGINE_ROUTES].bind(state.engine)
        state.engine.events.subscribe(log_lifecycle)
        kv_events = start_kv_events(config.kv_events, state.engine.subscribe_kv_events,
                                    state.engine.kv_snapshot_events)
    except Exception as exc:  # noqa: BLE001 - a taken port or a model that fails to load: exit 1
        log.error("server_start_failed", error=str(exc))
        await runner.cleanup()
        if state.engine is not None:
            await state.engine.shutdown()
        return 1
    log.info("server_ready", host=config.server.host, port=config.server.port,
             model=state.engine.info.model_name)
    await stop.wait()
    await drain(state, config.server.drain_grace_s)
    await runner.cleanup()
    await state.engine.shutdown()
    if kv_events is not None:
        kv_events.close()
    log.info("server_stopped")
    return 0


def _on_signal(state: ServerState, stop: asyncio.Event, sig: signal.Signals) -> None:
    if not state.draining:
        log.info("draining", signal=sig.name, in_flight=len(state.live))
    state.draining = True  # /health turns 503 and new work is refused from now on
    stop.set()


async def drain(state: ServerState, grace_s: float) -> None:
    """Wait for live generations up to `grace_s`, then abort what is left."""
    state.draining = True
    await _wait_idle(state, grace_s)
    if state.live:
        log.warning("drain_timeout", aborted=len(state.live))
        for sub in list(state.live):
            sub.abort()
        await _wait_idle(state, ABORT_WAIT_S)


async def _wait_idle(state: ServerState, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while state.live and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
