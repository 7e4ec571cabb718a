"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The syntax of Hermes, Qwen 2.5/3 and the fallback tool prompt (plugins/http/tool_prompt.py).
Text outside the tags is content; whitespace next to a call (the separator models put
between calls and text) is dropped. A block whose JSON is not a call, and a block still
open when the reply ends, stay content, tags included.
"""

from __future__ import annotations

from kernel.registry import register
from kernel.structured.tool_parser import Piece, ToolParser, call_from_json, held_prefix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@register("tool_parser", "hermes")
class HermesParser(ToolParser):
    def __init__(self) -> None:
        self._buffer = ""  # text not yet given out
        self._in_call = False  # the buffer is inside an open tag (the tag itself consumed)
        self._after_call = False  # whitespace at the buffer's start follows a call: drop it
        self._gap = ""  # the whitespace before the open tag: given back if the block is no call

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return [p for p in out if p != ""]

    def finish(self) -> list[Piece]:
        rest = self._gap + OPEN + self._buffer if self._in_call else self._buffer
        if self._after_call:
            rest = rest.lstrip()
        self._buffer, self._in_call, self._after_call, self._gap = "", False, False, ""
        return [rest] if rest else []

    def _step(self, out: list[Piece]) -> bool:
        """Give out what the buffer makes certain; True while there may be more."""
        if self._in_call:
            return self._close_call(out)
        if self._after_call:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._after_call = False
        start = self._buffer.find(OPEN)
        if start >= 0:
            before = self._buffer[:start]
            out.append(before.rstrip())  # the space before a call is a separator ...
            self._gap = before[len(before.rstrip()):]  # ... unless the block turns out not to be one
            self._buffer, self._in_call = self._buffer[start + len(OPEN):], True
            return True
        # NOTE: hold back a possible start of a tag, and trailing space (it is dropped if
        # a call follows): the content given out never has to be taken back.
        cut = len(self._buffer) - held_prefix(self._buffer, OPEN)
        sure = self._buffer[:cut].rstrip()
        out.append(sure)
        self._buffer = self._buffer[len(sure):]
        return False

    def _close_call(self, out: list[Piece]) -> bool:
        end = self._buffer.find(CLOSE)
        if end < 0:
            return False
        body, raw = self._buffer[:end], OPEN + self._buffer[:end + len(CLOSE)]
        self._buffer, self._in_call = self._buffer[end + len(CLOSE):], False
        call = call_from_json(body, raw)
        out.append(call if call is not None else self._gap + raw)
        self._gap = ""
        self._after_call = call is not None
        return True
