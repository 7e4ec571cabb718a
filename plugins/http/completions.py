"""POST /v1/completions: OpenAI's legacy text completions, streamed or not."""

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
from plugins.http.logprobs import TokenNames, completion_logprobs
from plugins.http.protocol import (
    Prompt,
    check_model,
    get_bool,
    get_int,
    get_n,
    get_stream,
    parse_prompts,
    read_body,
    reject_unsupported,
)
from plugins.http.sampling import build_params, expand, get_max_tokens
from plugins.http.sse import EventStream, json_response
from plugins.http.state import state_of
from plugins.http.submission import Submission

NAMES = {"max_new_tokens": "max_tokens", "top_logprobs_num": "logprobs"}
_HARMLESS: dict[str, tuple[Any, ...]] = {"suffix": ("",), "logit_bias": ({},), "best_of": (1,)}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[Prompt]
    n: int
    params: SamplingParams
    echo: bool
    logprobs: bool
    stream: bool
    include_usage: bool


def parse_completion(body: dict[str, Any], engine: AsyncEngine) -> CompletionRequest:
    check_model(body, engine.parts.model_name)
    reject_unsupported(body, _HARMLESS)
    prompts = parse_prompts(body.get("prompt"))
    top_n = get_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    echo = get_bool(body, "echo")
    if echo and top_n is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which this server does not compute",
                          param="echo")
    stream, include_usage = get_stream(body)
    max_tokens = get_max_tokens(body, "max_tokens") or DEFAULT_MAX_TOKENS
    params = build_params(body, max_tokens, top_n, NAMES)
    return CompletionRequest(prompts, get_n(body), params, echo, top_n is not None, stream, include_usage)


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    engine = state.require_engine()
    req = parse_completion(await read_body(request), engine)
    reply = _Reply(engine, req)
    async with state.generation(expand(req.prompts, req.params, req.n), NAMES) as sub:
        if req.stream:
            return await reply.stream(request, sub)
        return await reply.collect(sub)


def _prompt_text(engine: AsyncEngine, prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(prompt) if engine.tokenizer is not None else ""


class _Reply:
    """Builds one completion's response objects, whole or as stream chunks."""

    def __init__(self, engine: AsyncEngine, req: CompletionRequest) -> None:
        self.req = req
        self.names = TokenNames(engine.tokenizer)
        self.head = {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": engine.parts.model_name,
        }
        # What each choice's text starts with (echo), and its next logprob text offset.
        self.prefix = [_prompt_text(engine, p) if req.echo else "" for p in req.prompts for _ in range(req.n)]
        self.offset = [len(p) for p in self.prefix]

    def _logprobs(self, i: int, ids: list[int], lps: list[float], tops: list[Any]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        out = completion_logprobs(self.names, ids, lps, tops, self.offset[i])
        self.offset[i] += sum(len(t) for t in out["tokens"])
        return out

    async def collect(self, sub: Submission) -> web.Response:
        choices = await collect_choices(sub)
        body = dict(self.head)
        body["choices"] = [
            {
                "index": c.index, "text": self.prefix[c.index] + c.text,
                "logprobs": self._logprobs(c.index, c.token_ids, c.logprobs, c.top_logprobs),
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
            async for i, chunk in sub.events():
                choices[i].add(chunk)
                text, self.prefix[i] = self.prefix[i] + chunk.text, ""
                if text or chunk.finished or (self.req.logprobs and chunk.token_ids):
                    await events.send(self._chunk(i, text, chunk.token_ids, chunk.logprobs,
                                                  chunk.top_logprobs, chunk.finish_reason))
            if self.req.include_usage:
                await events.send({**self.head, "choices": [], "usage": usage(choices, self.req.n)})
        except APIError as exc:  # the status line is gone: report in-band, as OpenAI does
            await events.send(exc.body())
        return await events.finish()

    def _chunk(self, i: int, text: str, ids: list[int], lps: list[float], tops: list[Any],
               finish: str | None) -> dict[str, Any]:
        choice = {"index": i, "text": text, "logprobs": self._logprobs(i, ids, lps, tops),
                  "finish_reason": finish}
        out: dict[str, Any] = {**self.head, "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out
