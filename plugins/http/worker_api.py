"""The routes a router calls on its workers, in the shapes SGLang's and vLLM's routers
parse (issue 26): a router behind which tierserve replicas run registers each one under
its model, reads its load and flushes its cache through these.

- `GET /model_info` (and SGLang's older `/get_model_info`): model_path, tokenizer_path
  (a folder with tokenizer.json, else null: a GGUF file's tokenizer is not one a router
  loads), is_generation, served_model_name, model_type / architectures, context and
  vocabulary sizes.
- `GET /get_server_info`: `/server_info`'s body, which carries the fields the routers read
  (model_path, served_model_name, max_running_requests, max_total_num_tokens,
  max_prefill_tokens, block_size, dp_size, tp_size) beside tierserve's own.
- `GET /get_load`: one entry per data-parallel rank (one here): {dp_rank, num_reqs,
  num_waiting_reqs, num_tokens}; num_tokens counts the KV tokens requests hold now
  (what SGLang's router sums to compare workers).
- `POST /flush_cache`: empties the prefix cache; 400 while requests are in flight.

All of them are API routes: `server.api_key` guards them (routers send it as a bearer token).
"""

from __future__ import annotations

from aiohttp import web

from kernel.async_engine import AsyncEngine
from kernel.config import Config
from plugins.http.errors import APIError
from plugins.http.native_api import running_engine, server_info, tokenizer_path
from plugins.http.state import state_of
from plugins.jsonio import json_response


def engine_of(request: web.Request) -> tuple[Config, AsyncEngine]:
    return state_of(request).config, running_engine(request)


async def model_info(request: web.Request) -> web.Response:
    config, engine = engine_of(request)
    info = engine.info
    return json_response({
        "model_path": config.model.path,
        "tokenizer_path": tokenizer_path(config.model.path),
        "is_generation": True,
        "served_model_name": info.model_name,
        "model_type": info.architecture,
        "architectures": [info.architecture],
        "max_context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "weight_version": None,
        "preferred_sampling_params": None,
    })


async def get_load(request: web.Request) -> web.Response:
    _, engine = engine_of(request)
    stats = engine.stats()
    pages, requests = stats["pages"], stats["requests"]
    held = pages["usable"] - pages["free"] - pages["evictable"]  # in use by requests (shared ones once)
    return json_response([{
        "dp_rank": 0,
        "num_reqs": requests["running"] + requests["waiting"],
        "num_waiting_reqs": requests["waiting"],
        "num_tokens": held * engine.info.page_size,
    }])


async def flush_cache(request: web.Request) -> web.Response:
    _, engine = engine_of(request)
    ok, reason = engine.flush_cache()
    if not ok:
        raise APIError(400, reason, code="requests_in_flight")
    return json_response({"ok": True, "message": reason})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_post("/flush_cache", flush_cache)
