"""POST /v1/completions: OpenAI's legacy text completions, streamed or not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from aiohttp import web

from kernel.async_engine import AsyncEngine, OutputChunk
from kernel.results.output import PromptScores
from kernel.sampling_params import MAX_NEW_TOKENS_LIMIT, MAX_TOP_LOGPROBS, SamplingParams
from plugins.http.choice import Choice
from plugins.http.errors import bad_request
from plugins.http.logprobs import completion_logprobs
from plugins.http.prompt_logprobs import (
    echo_logprobs,
    join_logprobs,
    prompt_logprob_fields,
    vllm_prompt_logprobs,
)
from plugins.http.protocol import (
    MAX_N,
    Prompt,
    PromptInput,
    StreamOptions,
    bounds,
    check_model,
    get_bool,
    get_int,
    get_n,
    get_stream,
    parse_prompts,
    read_body,
    reject_unsupported,
)
from plugins.http.reply import JSON, Reply
from plugins.http.response_format import ResponseFormat
from plugins.http.sampling import PASSTHROUGH, build_params, expand
from plugins.http.state import state_of

NAMES = {"max_new_tokens": "max_tokens", "top_logprobs_num": "logprobs", "json_schema": "response_format"}
_HARMLESS: dict[str, tuple[Any, ...]] = {"suffix": ("",), "best_of": (1,)}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass(frozen=True)
class CompletionBody:
    """The JSON body `parse_completion` reads, field by field: /openapi.json's schema of it.

    Unknown fields are ignored (clients send `user` and the like); the SamplingParams
    fields named in SAMPLING_FIELDS are accepted too, under the engine's own names.
    """

    SAMPLING_FIELDS: ClassVar[tuple[str, ...]] = PASSTHROUGH

    prompt: PromptInput
    model: str | None = None
    # 0 only with echo: the prompt is scored (with logprobs) or echoed, nothing generated.
    max_tokens: int | None = field(default=DEFAULT_MAX_TOKENS, metadata=bounds(0, MAX_NEW_TOKENS_LIMIT))
    n: int | None = field(default=1, metadata=bounds(1, MAX_N))
    logprobs: int | None = field(default=None, metadata=bounds(0, MAX_TOP_LOGPROBS))  # top-n per token
    echo: bool | None = False  # with logprobs: the logprobs cover the prompt too
    # vLLM's extension: per prompt token its logprob, rank and this many top tokens.
    prompt_logprobs: int | None = field(default=None, metadata=bounds(0, MAX_TOP_LOGPROBS))
    stream: bool | None = False
    stream_options: StreamOptions | None = None  # only with stream
    response_format: ResponseFormat | None = None  # structured outputs, as on chat (an extension)
    # Accepted only as "not used" (see _HARMLESS): refused rather than ignored otherwise.
    suffix: Literal[""] | None = None
    best_of: Literal[1] | None = None


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[Prompt]
    n: int
    params: SamplingParams
    echo: bool
    logprobs: bool
    stream: bool
    include_usage: bool
    prompt_logprobs: bool = False  # vLLM's per-choice prompt_logprobs list


def parse_completion(body: dict[str, Any], engine: AsyncEngine) -> CompletionRequest:
    check_model(body, engine.info.model_name)
    reject_unsupported(body, _HARMLESS)
    prompts = parse_prompts(body.get("prompt"))
    top_n = get_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    echo = get_bool(body, "echo")
    stream, include_usage = get_stream(body)
    max_tokens = get_int(body, "max_tokens", 0, MAX_NEW_TOKENS_LIMIT)
    if max_tokens == 0 and not echo:
        raise bad_request("max_tokens must be at least 1 unless echo is true (a prompt scored, nothing "
                          "generated)", param="max_tokens")
    scoring = prompt_logprob_fields(body, echo, top_n, stream)
    params = build_params(body, DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, top_n, NAMES, scoring)
    return CompletionRequest(prompts, get_n(body), params, echo, top_n is not None, stream, include_usage,
                             body.get("prompt_logprobs") is not None)


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    engine = state.require_engine()
    req = parse_completion(await read_body(request), engine)
    reply = CompletionReply(engine, req)
    async with state.generation(expand(req.prompts, req.params, req.n), NAMES) as sub:
        return await reply.respond(request, sub, req.stream)


def _prompt_text(engine: AsyncEngine, prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(prompt) if engine.tokenizer is not None else ""


class CompletionReply(Reply):
    """Legacy shapes: a `text` per choice (after the echoed prompt), legacy logprobs."""

    id_prefix, whole_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, engine: AsyncEngine, req: CompletionRequest) -> None:
        super().__init__(engine, req.n, req.include_usage, req.logprobs)
        self.echo, self.prompt_logprobs = req.echo, req.prompt_logprobs
        # What each choice's text starts with (echo), and its next logprob text offset.
        self.prefix = [_prompt_text(engine, p) if req.echo else "" for p in req.prompts for _ in range(req.n)]
        self.offset = [len(p) for p in self.prefix]

    def _logprobs(self, i: int, ids: list[int], lps: list[float], tops: list[Any]) -> JSON | None:
        if not self.want_logprobs:
            return None
        out = completion_logprobs(self.names, ids, lps, tops, self.offset[i])
        self.offset[i] += sum(len(t) for t in out["tokens"])
        return out

    def _with_prompt(self, logprobs: JSON | None, prompt: PromptScores | None) -> JSON | None:
        """Echo: the prompt's logprobs first (prompt scores come with a choice's first chunk)."""
        if logprobs is None or not self.echo or prompt is None:
            return logprobs
        return join_logprobs(echo_logprobs(self.names, prompt), logprobs)

    def whole_choice(self, choice: Choice) -> JSON:
        i = choice.index
        out: JSON = {
            "index": i, "text": self.prefix[i] + choice.text,
            "logprobs": self._with_prompt(
                self._logprobs(i, choice.token_ids, choice.logprobs, choice.top_logprobs), choice.prompt
            ),
            "finish_reason": choice.finish_reason,
        }
        if self.prompt_logprobs:
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.names, choice.prompt) if choice.prompt else None
        return out

    def delta_choices(self, index: int, chunk: OutputChunk) -> list[JSON]:
        text, self.prefix[index] = self.prefix[index] + chunk.text, ""  # the echo goes out once
        if not (text or chunk.finished or (self.want_logprobs and (chunk.token_ids or chunk.prompt))):
            return []
        return [{
            "index": index, "text": text,
            "logprobs": self._with_prompt(
                self._logprobs(index, chunk.token_ids, chunk.logprobs, chunk.top_logprobs), chunk.prompt
            ),
            "finish_reason": chunk.finish_reason,
        }]
