"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kernel.async_engine import AsyncEngine
from kernel.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from plugins.http.choice import collect_choices, new_choices, usage
from plugins.http.errors import APIError, bad_request
from plugins.http.logprobs import TokenNames, chat_logprobs
from plugins.http.protocol import (
    check_model,
    get_bool,
    get_int,
    get_n,
    get_stream,
    parse_messages,
    read_body,
    reject_unsupported,
)
from plugins.http.sampling import build_params, expand, get_max_tokens
from plugins.http.sse import EventStream, json_response
from plugins.http.state import state_of
from plugins.http.submission import Submission

NAMES = {"max_new_tokens": "max_completion_tokens", "top_logprobs_num": "top_logprobs"}
_HARMLESS: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},), "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "response_format": ({"type": "text"},),
}


@dataclass(frozen=True)
class ChatRequest:
    prompt_ids: list[int]
    n: int
    params: SamplingParams
    logprobs: bool
    stream: bool
    include_usage: bool


def render_prompt(engine: AsyncEngine, messages: object, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send token ids to /v1/completions", param="messages")
    parsed = parse_messages(messages)
    try:
        text = tokenizer.apply_chat_template(parsed, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:  # no template, or the template refused these messages
        raise bad_request(str(exc), param="messages") from None
    return tokenizer.encode(text)


def _room(engine: AsyncEngine, prompt_tokens: int) -> int:
    """Tokens left for the reply: the default max_tokens, as OpenAI's is "up to the context"."""
    pool_tokens = (engine.parts.num_pages - 1) * engine.config.cache.page_size
    room = min(engine.parts.context_length, pool_tokens) - prompt_tokens
    if room < 1:
        raise bad_request(f"the messages fill the context ({prompt_tokens} tokens)", param="messages")
    return room


def names_of(body: dict[str, Any]) -> dict[str, str]:
    """Engine field names -> the names this client used (max_tokens is the older alias)."""
    return NAMES if "max_completion_tokens" in body else {**NAMES, "max_new_tokens": "max_tokens"}


def parse_chat(body: dict[str, Any], engine: AsyncEngine) -> ChatRequest:
    check_model(body, engine.parts.model_name)
    reject_unsupported(body, _HARMLESS)
    want_logprobs = get_bool(body, "logprobs")
    top_n = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_n is not None and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    stream, include_usage = get_stream(body)
    limit = get_max_tokens(body, "max_completion_tokens") or get_max_tokens(body, "max_tokens")
    prompt_ids = render_prompt(engine, body.get("messages"))
    params = build_params(body, limit or _room(engine, len(prompt_ids)),
                          (top_n or 0) if want_logprobs else None, names_of(body))
    return ChatRequest(prompt_ids, get_n(body), params, want_logprobs, stream, include_usage)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    engine = state.require_engine()
    body = await read_body(request)
    req = parse_chat(body, engine)
    reply = _Reply(engine, req)
    async with state.generation(expand([req.prompt_ids], req.params, req.n), names_of(body)) as sub:
        if req.stream:
            return await reply.stream(request, sub)
        return await reply.collect(sub)


class _Reply:
    """Builds one chat completion's response objects, whole or as stream chunks."""

    def __init__(self, engine: AsyncEngine, req: ChatRequest) -> None:
        self.req = req
        self.names = TokenNames(engine.tokenizer)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = engine.parts.model_name

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, ids: list[int], lps: list[float], tops: list[Any]) -> dict[str, Any] | None:
        return chat_logprobs(self.names, ids, lps, tops) if self.req.logprobs else None

    async def collect(self, sub: Submission) -> web.Response:
        choices = await collect_choices(sub)
        body = self._head("chat.completion")
        body["choices"] = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        body["usage"] = usage(choices, self.req.n)
        return json_response(body)

    async def stream(self, request: web.Request, sub: Submission) -> web.StreamResponse:
        events = await EventStream().open(request)
        choices = new_choices(sub)
        try:
            for c in choices:
                await events.send(self._chunk(c.index, {"role": "assistant", "content": ""}))
            async for i, chunk in sub.events():
                choices[i].add(chunk)
                if chunk.text or (self.req.logprobs and chunk.token_ids):
                    lps = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
                    await events.send(self._chunk(i, {"content": chunk.text}, lps))
                if chunk.finished:
                    await events.send(self._chunk(i, {}, finish=chunk.finish_reason))
            if self.req.include_usage:
                await events.send({**self._head("chat.completion.chunk"), "choices": [],
                                   "usage": usage(choices, self.req.n)})
        except APIError as exc:  # the status line is gone: report in-band, as OpenAI does
            await events.send(exc.body())
        return await events.finish()

    def _chunk(self, i: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
               finish: str | None = None) -> dict[str, Any]:
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        out: dict[str, Any] = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out
