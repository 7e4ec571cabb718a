"""What the two OpenAI generation routes share: the response id, creation time and
model, the object heads, and the loops that collect or stream a submission.

`ChatReply` (chat.py) and `CompletionReply` (completions.py) only say how one choice
looks, whole or as a stream delta; everything about ordering, usage and errors is here.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from aiohttp import web

from kernel.async_engine import AsyncEngine, OutputChunk
from plugins.http.choice import Choice, collect_choices, new_choices, usage
from plugins.http.errors import APIError
from plugins.http.logprobs import TokenNames
from plugins.http.sse import EventStream
from plugins.http.submission import Submission
from plugins.jsonio import json_response

JSON = dict[str, Any]


class Reply(ABC):
    """Builds one response's objects, whole (`collect`) or as SSE chunks (`stream`)."""

    id_prefix: ClassVar[str]  # "chatcmpl", "cmpl"
    whole_object: ClassVar[str]  # the `object` of the whole response
    chunk_object: ClassVar[str]  # ... and of each stream chunk

    def __init__(self, engine: AsyncEngine, n: int, include_usage: bool, want_logprobs: bool) -> None:
        self.n = n  # choices per prompt: usage counts each prompt once
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs
        self.names = TokenNames(engine.tokenizer)
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = engine.info.model_name

    @abstractmethod
    def whole_choice(self, choice: Choice) -> JSON:
        """One finished choice of the whole response."""

    @abstractmethod
    def delta_choices(self, index: int, chunk: OutputChunk) -> list[JSON]:
        """The stream choices (often one, maybe none) that `chunk` of choice `index` adds."""

    def opening_choices(self, choices: list[Choice]) -> list[JSON]:
        """Stream choices sent before the first token (none unless a route needs them)."""
        return []

    def head(self, obj: str) -> JSON:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    async def respond(self, request: web.Request, sub: Submission, stream: bool) -> web.StreamResponse:
        return await self.stream(request, sub) if stream else await self.collect(sub)

    async def collect(self, sub: Submission) -> web.Response:
        choices = await collect_choices(sub)
        body = self.head(self.whole_object)
        body["choices"] = [self.whole_choice(c) for c in choices]
        body["usage"] = usage(choices, self.n)
        return json_response(body)

    async def stream(self, request: web.Request, sub: Submission) -> web.StreamResponse:
        events = await EventStream().open(request)
        choices = new_choices(sub)
        try:
            for opening in self.opening_choices(choices):
                await events.send(self.chunk(opening))
            async for i, chunk in sub.events():
                choices[i].add(chunk)
                for delta in self.delta_choices(i, chunk):
                    await events.send(self.chunk(delta))
            if self.include_usage:
                await events.send({**self.head(self.chunk_object), "choices": [], "usage": usage(choices, self.n)})
        except APIError as exc:  # the status line is gone: report in-band, as OpenAI does
            await events.send(exc.body())
        return await events.finish()

    def chunk(self, choice: JSON) -> JSON:
        out: JSON = {**self.head(self.chunk_object), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # OpenAI's shape: only the last chunk carries usage
        return out
