"""Native routes: /generate (engine parameters as they are), /health, /server_info."""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar, cast

from aiohttp import web

from kernel.async_engine import AsyncEngine
from kernel.config import Config
from kernel.sampling_params import SamplingParams, SamplingParamsError
from plugins.http.choice import collect_choices, new_choices
from plugins.http.errors import APIError, bad_request, halted, sampling_error
from plugins.http.protocol import Prompt, get_bool, read_body
from plugins.http.sse import EventStream
from plugins.http.state import state_of
from plugins.http.submission import Submission
from plugins.jsonio import json_response


@dataclass(frozen=True)
class GenerateBody:
    """POST /generate: exactly one of `text` and `input_ids`, each one prompt or a list of them
    (a list answers with a list); the engine's SamplingParams as they are."""

    # Also accepted at the top level (they override sampling_params').
    SAMPLING_FIELDS: ClassVar[tuple[str, ...]] = ("return_logprob", "top_logprobs_num", "logprob_start_len")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | None = None
    stream: bool | None = False


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def parse_inputs(body: dict[str, Any]) -> tuple[list[Prompt], bool]:
    """(prompts, batched) from exactly one of `text` and `input_ids`, each one or a list."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("send exactly one of text and input_ids", param="text")
    if isinstance(text, str) and text:
        return [text], False
    if isinstance(text, list) and text and all(isinstance(t, str) and t for t in text):
        return list(text), True
    if _is_ids(ids):
        return [cast(list[int], ids)], False
    if isinstance(ids, list) and ids and all(_is_ids(p) for p in ids):
        return [list(p) for p in ids], True
    param = "text" if ids is None else "input_ids"
    raise bad_request(f"{param} must be non-empty: a string / token-id list, or a list of them", param=param)


def parse_params(body: dict[str, Any]) -> SamplingParams:
    fields = body.get("sampling_params") or {}
    if not isinstance(fields, dict):
        raise bad_request("sampling_params must be an object", param="sampling_params")
    fields = dict(fields)
    for name in GenerateBody.SAMPLING_FIELDS:  # also accepted at top level
        if body.get(name) is not None:
            fields[name] = body[name]
    scoring = isinstance(fields.get("logprob_start_len"), int) and fields["logprob_start_len"] >= 0
    if not scoring and (fields.get("max_new_tokens") == 0 or fields.get("max_tokens") == 0):
        raise bad_request("max_new_tokens must be at least 1 (0 only to score a prompt: logprob_start_len >= 0)",
                          param="max_new_tokens")
    try:
        return SamplingParams.from_dict(fields)
    except SamplingParamsError as exc:
        raise sampling_error(exc, {}) from None


async def generate(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    state.require_engine()
    body = await read_body(request)
    prompts, batched = parse_inputs(body)
    params = parse_params(body)
    stream = get_bool(body, "stream")
    async with state.generation([(p, params) for p in prompts], {}) as sub:
        if stream:
            return await _stream(request, sub, params, batched)
        choices = await collect_choices(sub)
        outs = [c.native(params.return_logprob, params.top_logprobs_num > 0) for c in choices]
        return json_response(outs if batched else outs[0])


async def _stream(
    request: web.Request, sub: Submission, params: SamplingParams, batched: bool
) -> web.StreamResponse:
    """SSE of cumulative results (each event is the whole output so far), then [DONE]."""
    events = await EventStream().open(request)
    choices = new_choices(sub)
    try:
        async for i, chunk in sub.events():
            choices[i].add(chunk)
            out = choices[i].native(params.return_logprob, params.top_logprobs_num > 0)
            await events.send({"index": i, **out} if batched else out)
    except APIError as exc:
        await events.send(exc.body())
    return await events.finish()


async def health(request: web.Request) -> web.Response:
    """200 {"status": "ok"}; 503 while starting or draining, and an error once halted."""
    state = state_of(request)
    if state.engine is not None and state.engine.halt_reason is not None:
        raise halted(state.engine.halt_reason)  # the reason, for whoever reads the probe
    status = "draining" if state.draining else "starting" if state.engine is None else "ok"
    return json_response({"status": status}, status=200 if status == "ok" else 503)


def version() -> str:
    try:
        return metadata.version("tierserve")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def tokenizer_path(model_path: str) -> str | None:
    """The model's folder when it holds a Hugging Face tokenizer a router can load."""
    folder = os.path.expanduser(model_path)
    return folder if os.path.isfile(os.path.join(folder, "tokenizer.json")) else None


def router_fields(config: Config, engine: AsyncEngine) -> dict[str, Any]:
    """What SGLang's and vLLM's routers read from a worker's server info."""
    info = engine.info
    return {
        "model_path": config.model.path,
        "served_model_name": info.model_name,
        "tokenizer_path": tokenizer_path(config.model.path),
        "max_running_requests": config.scheduler.max_running_requests,
        "max_total_num_tokens": info.pool_tokens,
        "max_prefill_tokens": config.scheduler.chunked_prefill_size,
        "block_size": info.page_size,  # vLLM's router indexes KV blocks of this many tokens
        "dp_size": 1,
        "tp_size": config.parallel.tp_size,
    }


def pool_summary(stats: dict[str, Any]) -> dict[str, int]:
    """`/server_info`'s flat pool view of `engine.stats()` (which does the accounting)."""
    pages, requests = stats["pages"], stats["requests"]
    return {
        "free_pages": pages["free"],
        "usable_pages": pages["usable"],
        "cached_pages": pages["cached"],
        "running": requests["running"],
        "waiting": requests["waiting"],
    }


def running_engine(request: web.Request) -> AsyncEngine:
    """The server's engine; 503 while the model is still loading."""
    engine = state_of(request).engine
    if engine is None:
        raise APIError(503, "the server is starting; the model is still loading", code="starting")
    return engine


async def server_info(request: web.Request) -> web.Response:
    """Config (without keys), pool usage, counters and health; answered while draining
    or halted too, since that is when an operator looks."""
    state = state_of(request)
    engine = running_engine(request)
    stats = engine.stats()
    config = state.config.to_dict()
    for key in ("api_key", "admin_api_key"):  # secrets never leave the process
        config["server"].pop(key, None)
    return json_response({
        "version": version(),
        "model": engine.info.model_name,
        **router_fields(state.config, engine),
        "context_length": engine.info.context_length,
        "num_pages": engine.info.num_pages,
        "page_size": engine.info.page_size,
        "draining": state.draining,
        "halt_reason": stats["halt_reason"],
        "pool": pool_summary(stats),
        "cache": stats["cache"],
        "host": stats["host"],  # host tier capacity and traffic (None without hicache)
        "storage": stats["storage"],  # storage tier capacity and traffic (None without one)
        "counters": stats["counters"],
        "speculative": stats["speculative"],  # drafted / accepted tokens (None without speculation)
        "audit": stats["audit"],  # the online audit, its last mismatch (None while audit.sample_rate is 0)
        "parallel": stats["parallel"],  # tensor-parallel ranks, their pools and collectives (None at tp_size 1)
        "config": config,
    })


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
