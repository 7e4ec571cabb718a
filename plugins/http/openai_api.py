"""OpenAI routes: completions, chat, models, and the tokenize/detokenize helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gpu.tokenizer import Tokenizer
from kernel.async_engine import AsyncEngine
from plugins.http.chat import render_prompt
from plugins.http.chat_route import create_chat_completion
from plugins.http.completions import create_completion
from plugins.http.errors import APIError, bad_request
from plugins.http.protocol import ChatMessage, check_model, get_bool, read_body
from plugins.http.state import state_of
from plugins.jsonio import json_response


@dataclass(frozen=True)
class TokenizeBody:
    """POST /v1/tokenize: `prompt`, or `messages` (rendered with the chat template) if given."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = True  # with messages


@dataclass(frozen=True)
class DetokenizeBody:
    tokens: list[int]  # each in [0, vocab size)
    model: str | None = None


def _model_card(request: web.Request) -> dict[str, object]:
    state = state_of(request)
    engine = state.require_engine()
    return {
        "id": engine.info.model_name, "object": "model", "created": state.started_at,
        "owned_by": "tierserve", "max_model_len": engine.info.context_length,
    }


async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(request)]})


async def get_model(request: web.Request) -> web.Response:
    card = _model_card(request)
    name = request.match_info["model"]
    if name != card["id"]:
        raise APIError(404, f"the model `{name}` does not exist", param="model", code="model_not_found")
    return json_response(card)


async def _tokenizer_call(request: web.Request) -> tuple[AsyncEngine, Tokenizer, dict[str, Any]]:
    """The engine, its tokenizer and the request body of a (de)tokenize call."""
    engine = state_of(request).require_engine()
    body = await read_body(request)
    check_model(body, engine.info.model_name)
    if engine.tokenizer is None:
        raise bad_request("this model has no tokenizer")
    return engine, engine.tokenizer, body


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt": str} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}."""
    engine, tokenizer, body = await _tokenizer_call(request)
    if "messages" in body:
        ids = render_prompt(engine, body["messages"], get_bool(body, "add_generation_prompt", True))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("send prompt (a string) or messages (a list)", param="prompt")
        ids = tokenizer.encode(prompt)
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.info.context_length})


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"prompt": text}, special tokens kept so the text is faithful."""
    _, tokenizer, body = await _tokenizer_call(request)
    tokens = body.get("tokens")
    vocab = tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
    ):
        raise bad_request(f"tokens must be a list of integers in [0, {vocab})", param="tokens")
    return json_response({"prompt": tokenizer.decode(tokens, skip_special_tokens=False)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_post("/v1/detokenize", detokenize)
