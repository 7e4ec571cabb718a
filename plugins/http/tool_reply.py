"""Chat replies of requests that offer tools: `message.tool_calls`, or their stream deltas.

A `CallReader` per choice turns the generated text into events (content text, the start
of a call, a piece of its arguments). The whole response and the stream are built from
the same events, so both say the same. How the text is read depends on `tool_choice`:

- auto: the configured parser (`server.tool_parser`) finds the calls; a call of a
  function the request did not offer stays content (its text as written). Without
  `parallel_tool_calls` only the first call is kept.
- named: the text is the arguments object itself (generated under the function's
  parameters schema); the call starts with the reply and its arguments stream as written.
- required: the text is one `{"name", "arguments"}` object (generated under the schema
  of any offered function's call); it is read once the reply ends.

`finish_reason` is "tool_calls" when the reply holds a call and stopped by itself; a
reply cut by max_tokens keeps "length" (and a named call its arguments so far).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

from kernel.async_engine import AsyncEngine, OutputChunk
from kernel.structured.tool_parser import Piece, ToolCall, ToolParser, call_from_json
from plugins.http.chat import ChatReply, ChatRequest, delta_choice
from plugins.http.choice import Choice
from plugins.http.reply import JSON
from plugins.http.tools import ToolUse


@dataclass(frozen=True)
class CallStart:
    index: int  # of the call within the reply
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str  # the next piece of the call's arguments (JSON text)


Event = str | CallStart | CallArgs


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallReader(ABC):
    """One choice's generated text -> events, piece by piece (`feed`) then `finish`."""

    def __init__(self) -> None:
        self.calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Event]: ...

    @abstractmethod
    def finish(self) -> list[Event]: ...

    def start(self, name: str) -> CallStart:
        self.calls += 1
        return CallStart(self.calls - 1, call_id(), name)

    def whole(self, name: str, arguments: str) -> list[Event]:
        begun = self.start(name)
        return [begun, CallArgs(begun.index, arguments)]


class ParsedReader(CallReader):
    """tool_choice auto: the model's own call syntax, read by a registered parser."""

    def __init__(self, parser: ToolParser, use: ToolUse) -> None:
        super().__init__()
        self.parser, self.names, self.parallel = parser, use.names, use.parallel

    def feed(self, text: str) -> list[Event]:
        return self._events(self.parser.feed(text))

    def finish(self) -> list[Event]:
        return self._events(self.parser.finish())

    def _events(self, pieces: list[Piece]) -> list[Event]:
        out: list[Event] = []
        for piece in pieces:
            if not isinstance(piece, ToolCall):
                out.append(piece)
            elif piece.name not in self.names:
                out.append(piece.raw)  # not a function of this request: the model's text
            elif self.parallel or self.calls == 0:
                out += self.whole(piece.name, piece.arguments)
        return out


class NamedReader(CallReader):
    """tool_choice naming a function: the whole text is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = [self.start(self.name)] if self.calls == 0 else []
        return out + [CallArgs(0, text)] if text else out

    def finish(self) -> list[Event]:
        return self.feed("")


class RequiredReader(CallReader):
    """tool_choice required: the whole text is one {"name", "arguments"} object."""

    def __init__(self, use: ToolUse) -> None:
        super().__init__()
        self.names = use.names
        self.text = ""

    def feed(self, text: str) -> list[Event]:
        self.text += text
        return []

    def finish(self) -> list[Event]:
        call = call_from_json(self.text)
        if call is None or call.name not in self.names:  # cut short: what was written, as content
            return [self.text] if self.text else []
        return self.whole(call.name, call.arguments)


def reader_for(use: ToolUse, parser: type[ToolParser]) -> CallReader:
    if use.mode == "named" and use.named is not None:
        return NamedReader(use.named.name)
    if use.mode == "required":
        return RequiredReader(use)
    return ParsedReader(parser(), use)


def finish_reason(engine_reason: str | None, reader: CallReader) -> str | None:
    return "tool_calls" if reader.calls and engine_reason == "stop" else engine_reason


def whole_message(events: list[Event]) -> JSON:
    """The assistant message the events add up to (content null when there is none, as
    the stream's opening delta says before it knows)."""
    content = "".join(e for e in events if isinstance(e, str))
    calls: list[JSON] = []
    for event in events:
        if isinstance(event, CallStart):
            calls.append({"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, CallArgs):
            calls[event.index]["function"]["arguments"] += event.text
    message: JSON = {"role": "assistant", "content": content or None, "refusal": None}
    if calls:
        message["tool_calls"] = calls
    return message


def event_delta(event: Event) -> JSON:
    """OpenAI's stream form: a call opens with its id, type and name, then its arguments."""
    if isinstance(event, str):
        return {"content": event}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


class ToolChatReply(ChatReply):
    """ChatReply for a request whose model may call tools (tool_choice other than none)."""

    def __init__(self, engine: AsyncEngine, req: ChatRequest, parser: type[ToolParser]) -> None:
        super().__init__(engine, req.n, req.include_usage, req.logprobs)
        self.use, self.parser = req.tools, parser
        self.readers: dict[int, CallReader] = {}  # per streamed choice

    def opening_choices(self, choices: list[Choice]) -> list[JSON]:
        return [delta_choice(c.index, {"role": "assistant", "content": None}) for c in choices]

    def whole_choice(self, choice: Choice) -> JSON:
        reader = reader_for(self.use, self.parser)
        events = reader.feed(choice.text) + reader.finish()
        return {
            "index": choice.index,
            "message": whole_message(events),
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs, choice.top_logprobs),
            "finish_reason": finish_reason(choice.finish_reason, reader),
        }

    def delta_choices(self, index: int, chunk: OutputChunk) -> list[JSON]:
        reader = self.readers.setdefault(index, reader_for(self.use, self.parser))
        events = reader.feed(chunk.text) + (reader.finish() if chunk.finished else [])
        deltas = [event_delta(e) for e in events]
        lps = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs) if chunk.token_ids else None
        if lps is not None and not deltas:  # the tokens' text is held back: their logprobs are not
            deltas = [{"content": ""}]
        out = [delta_choice(index, d, lps if k == 0 else None) for k, d in enumerate(deltas)]
        if chunk.finished:
            out.append(delta_choice(index, {}, finish=finish_reason(chunk.finish_reason, reader)))
        return out
