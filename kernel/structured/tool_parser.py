"""Tool-call parsers (registry kind `tool_parser`): a model's reply -> content and calls.

A parser reads one reply incrementally: `feed` takes each new piece of text and returns
what is now certain (content text, or a whole call); `finish` flushes the rest at the end.
`parse_reply` of a whole text is `feed` + `finish`, so a streamed reply and a whole one
come out the same by construction, however the text was chunked.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: `arguments` is the JSON text of an object."""

    name: str
    arguments: str
    raw: str  # the reply text it was read from: the content again if the call is refused


Piece = str | ToolCall  # content text, or a whole call


@dataclass(frozen=True)
class ParsedReply:
    content: str
    calls: tuple[ToolCall, ...]


class ToolParser(ABC):
    """One reply's parser (a fresh instance per reply: it holds the streaming state)."""

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """What `text` (the reply's next piece) makes certain, in reply order."""

    @abstractmethod
    def finish(self) -> list[Piece]:
        """What is left once the reply has ended (an unfinished call is content)."""


def parse_reply(parser: ToolParser, text: str) -> ParsedReply:
    """A whole reply: content (the text pieces joined) and the calls, in order."""
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return ParsedReply(content, tuple(p for p in pieces if isinstance(p, ToolCall)))


def call_from_json(text: str, raw: str | None = None) -> ToolCall | None:
    """`{"name": str, "arguments": {...}}` -> a call; None unless it is exactly that shape.

    `arguments` may be missing (no arguments) or a JSON string of an object (some models
    write it so); "parameters" is read as its synonym. The arguments are written back as
    compact JSON, so every parser gives the client the same text for the same call.
    """
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), text if raw is None else raw)


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`: held back
    while streaming, as the next piece may complete the tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
