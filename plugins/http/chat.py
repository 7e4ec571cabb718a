"""POST /v1/chat/completions, its parts: the body read into a ChatRequest (messages through
the model's chat template) and the plain reply; the route itself is plugins/http/chat_route.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from kernel.async_engine import AsyncEngine, OutputChunk
from kernel.sampling_params import MAX_NEW_TOKENS_LIMIT, MAX_TOP_LOGPROBS, SamplingParams
from plugins.http.choice import Choice
from plugins.http.errors import bad_request
from plugins.http.logprobs import chat_logprobs
from plugins.http.protocol import (
    MAX_N,
    ChatMessage,
    StreamOptions,
    bounds,
    check_model,
    get_bool,
    get_int,
    get_n,
    get_stream,
    parse_messages,
)
from plugins.http.reply import JSON, Reply
from plugins.http.response_format import ResponseFormat
from plugins.http.sampling import PASSTHROUGH, build_params, get_max_tokens
from plugins.http.submission import token_limit
from plugins.http.tool_prompt import template_inputs
from plugins.http.tool_schema import with_forced_call
from plugins.http.tools import Function, NamedToolChoice, Tool, ToolUse, parse_tool_use

NAMES = {"max_new_tokens": "max_completion_tokens", "top_logprobs_num": "top_logprobs",
         "json_schema": "response_format"}


@dataclass(frozen=True)
class ChatBody:
    """The JSON body `parse_chat` reads, field by field: /openapi.json's schema of it.

    Unknown fields are ignored; the SamplingParams fields named in SAMPLING_FIELDS are
    accepted too. Without a token limit the reply may fill the context.
    """

    SAMPLING_FIELDS: ClassVar[tuple[str, ...]] = PASSTHROUGH

    messages: list[ChatMessage] = field(metadata={"schema": {"minItems": 1}})
    model: str | None = None
    max_completion_tokens: int | None = field(default=None, metadata=bounds(1, MAX_NEW_TOKENS_LIMIT))
    max_tokens: int | None = field(default=None, metadata=bounds(1, MAX_NEW_TOKENS_LIMIT))  # the older name
    n: int | None = field(default=1, metadata=bounds(1, MAX_N))
    logprobs: bool | None = False
    top_logprobs: int | None = field(default=None, metadata=bounds(0, MAX_TOP_LOGPROBS))  # needs logprobs
    stream: bool | None = False
    stream_options: StreamOptions | None = None  # only with stream
    tools: list[Tool] | None = field(default=None, metadata={"schema": {"maxItems": 128}})
    # default: "auto" with tools, "none" without (plugins/http/tools.py, tool_reply.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True  # false: at most one call per reply
    # The deprecated function-calling fields: refused (send tools / tool_choice).
    functions: list[Any] | None = field(default=None, metadata={"schema": {"maxItems": 0}})
    function_call: None = None
    response_format: ResponseFormat | None = None  # structured outputs (plugins/http/response_format.py)


@dataclass(frozen=True)
class ChatRequest:
    prompt_ids: list[int]
    n: int
    params: SamplingParams
    logprobs: bool
    stream: bool
    include_usage: bool
    tools: ToolUse


def render_prompt(
    engine: AsyncEngine, messages: object, add_generation_prompt: bool = True, functions: tuple[Function, ...] = (),
) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template (`functions`
    shown to the model, plugins/http/tool_prompt.py)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send token ids to /v1/completions", param="messages")
    parsed, extra = template_inputs(tokenizer.chat_template, parse_messages(messages), functions)
    try:
        text = tokenizer.apply_chat_template(parsed, add_generation_prompt=add_generation_prompt, **extra)
    except ValueError as exc:  # no template, or the template refused these messages
        raise bad_request(str(exc), param="messages") from None
    return tokenizer.encode(text)


def _room(engine: AsyncEngine, prompt_tokens: int) -> int:
    """Tokens left for the reply: the default max_tokens, as OpenAI's is "up to the context"."""
    room = token_limit(engine.info) - prompt_tokens
    if room < 1:
        raise bad_request(f"the messages fill the context ({prompt_tokens} tokens)", param="messages")
    return room


def names_of(body: dict[str, Any]) -> dict[str, str]:
    """Engine field names -> the names this client used (max_tokens is the older alias)."""
    return NAMES if "max_completion_tokens" in body else {**NAMES, "max_new_tokens": "max_tokens"}


def parse_chat(body: dict[str, Any], engine: AsyncEngine) -> ChatRequest:
    check_model(body, engine.info.model_name)
    tools = parse_tool_use(body)
    want_logprobs = get_bool(body, "logprobs")
    top_n = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_n is not None and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    stream, include_usage = get_stream(body)
    limit = get_max_tokens(body, "max_completion_tokens") or get_max_tokens(body, "max_tokens")
    prompt_ids = render_prompt(engine, body.get("messages"), functions=tools.rendered)
    params = build_params(body, limit or _room(engine, len(prompt_ids)),
                          (top_n or 0) if want_logprobs else None, names_of(body))
    params = with_forced_call(params, tools)  # tool_choice required / named
    return ChatRequest(prompt_ids, get_n(body), params, want_logprobs, stream, include_usage, tools)


class ChatReply(Reply):
    """Chat shapes: a `message` per choice; stream deltas open with the assistant role."""

    id_prefix, whole_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _logprobs(self, ids: list[int], lps: list[float], tops: list[Any]) -> dict[str, Any] | None:
        return chat_logprobs(self.names, ids, lps, tops) if self.want_logprobs else None

    def whole_choice(self, choice: Choice) -> JSON:
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text, "refusal": None},
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs, choice.top_logprobs),
            "finish_reason": choice.finish_reason,
        }

    def opening_choices(self, choices: list[Choice]) -> list[JSON]:
        return [delta_choice(c.index, {"role": "assistant", "content": ""}) for c in choices]

    def delta_choices(self, index: int, chunk: OutputChunk) -> list[JSON]:
        out = []
        if chunk.text or (self.want_logprobs and chunk.token_ids):
            lps = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
            out.append(delta_choice(index, {"content": chunk.text}, lps))
        if chunk.finished:  # OpenAI ends each choice with an empty delta and the reason
            out.append(delta_choice(index, {}, finish=chunk.finish_reason))
        return out


def delta_choice(index: int, delta: JSON, logprobs: JSON | None = None, finish: str | None = None) -> JSON:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
