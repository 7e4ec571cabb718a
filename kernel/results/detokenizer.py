"""Incremental detokenization for streaming, with stop strings cut out of the output.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and some decoders
(SentencePiece's leading-space rule) change a token's text depending on what precedes it.
So each step decodes a small window: the tokens from `prefix_offset` (already emitted,
kept as context) to the end, and releases only what that window adds over its
already-emitted part, and only once it does not end in U+FFFD (an unfinished character).

Stop strings: released text passes through a hold-back buffer that keeps the longest
suffix which could still grow into a stop string, so no part of a stop string is ever
streamed. The first stop string to complete in the text wins (on a tie, the one that
starts earlier), which makes the result independent of how the text splits into tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

_REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes, so a window this long that still ends in U+FFFD
# holds invalid bytes (or tokens with no text); releasing it bounds the per-token cost.
_MAX_WINDOW = 32


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class DetokenizerStep(NamedTuple):
    text: str
    stop_hit: bool
    matched_stop: str | None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True,
                 stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: emitted tokens kept as decoding context
        self._read_offset = 0  # tokens before this have had their text released
        self._held = ""  # decoded text held back as a possible stop-string prefix
        self._released: list[str] = []
        self._stopped = False
        self._finished = False

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._released)

    def push(self, token_ids: Sequence[int]) -> DetokenizerStep:
        """Add generated tokens; return the text they release and whether a stop string hit."""
        if self._stopped or self._finished:
            raise RuntimeError("push() after the detokenizer stopped or finished")
        self._ids.extend(token_ids)
        return self._release(self._decode_new(force=False))

    def finish(self) -> str:
        """Release everything held back (the request ended for another reason)."""
        if self._stopped or self._finished:
            return ""
        self._finished = True
        step = self._release(self._decode_new(force=True))
        if step.stop_hit:
            return step.text
        tail, self._held = self._held, ""
        self._released.append(tail)
        return step.text + tail

    def _decode_new(self, force: bool) -> str:
        """Text the tokens past read_offset add, or "" while it ends mid-character."""
        ids = self._ids
        if self._read_offset == len(ids):
            return ""
        prefix = self._decode(ids[self._prefix_offset:self._read_offset])
        full = self._decode(ids[self._prefix_offset:])
        clean = not full.endswith(_REPLACEMENT)
        if force or (clean and len(full) > len(prefix)):
            return self._advance(len(ids), full[len(prefix):])
        if len(ids) - self._prefix_offset <= _MAX_WINDOW:
            return ""
        if clean:  # only tokens without text (skipped special tokens) since the last release
            return self._advance(len(ids), full[len(prefix):])
        return self._release_before_tail(prefix, full)

    def _release_before_tail(self, prefix: str, full: str) -> str:
        """Release a long window of invalid bytes up to a cut that splits no character.

        A cut is safe when decoding both sides apart gives the same text as decoding them
        together (and the right side has text): then no byte sequence spans it, now or
        after later tokens. An unfinished character spans at most 3 bytes, so a few
        candidate cuts near the end suffice.
        """
        ids = self._ids
        for cut in range(len(ids) - 1, max(self._read_offset, len(ids) - 4), -1):
            head = self._decode(ids[self._prefix_offset:cut])
            tail = self._decode(ids[cut:])
            if tail and head + tail == full:
                return self._advance(cut, head[len(prefix):])
        return ""

    def _advance(self, read_to: int, released: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = read_to
        return released

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _release(self, new_text: str) -> DetokenizerStep:
        pending = self._held + new_text
        hit = self._find_stop(pending)
        if hit is not None:
            start, matched = hit
            self._stopped = True
            self._held = ""
            return self._emit(pending[:start], matched)
        keep = self._stop_prefix_length(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return self._emit(pending[:len(pending) - keep], None)

    def _emit(self, text: str, matched: str | None) -> DetokenizerStep:
        self._released.append(text)
        return DetokenizerStep(text, matched is not None, matched)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first, earliest start on ties."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self._stop), default=1) - 1
        for n in range(min(longest, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
