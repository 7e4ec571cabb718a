"""`speculative.method: ngram` (prompt lookup): first what the radix tree holds right after
the request's tokens (the same prefix computed before: a repeated prompt, `n` > 1, a
retry); else the longest suffix of the request's tokens, ngram_max down to ngram_min
long, that occurred before in its prompt or output proposes the tokens that followed its
latest earlier occurrence."""

from __future__ import annotations

from typing import Any

from kernel.registry import register
from kernel.request import Request
from kernel.speculative.drafter import Drafter


class _Index:
    """Per request: for each n-gram length, the n-gram -> the position right after its
    latest occurrence that has a token after it. Grows as tokens are appended (tokens
    never change once known; a retracted request keeps its tokens)."""

    def __init__(self, lengths: range) -> None:
        self.lengths = lengths
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in lengths}
        self.indexed = 0  # n-grams ending before this position are in `after`

    def extend(self, tokens: list[int]) -> None:
        # The n-gram ending at the last token has no token after it yet: indexed next time.
        for end in range(self.indexed + 1, len(tokens)):
            for n in self.lengths:
                if end >= n:
                    self.after[n][tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)


def _continue(tokens: list[int], start: int, count: int) -> list[int]:
    """`count` tokens from `start` on. NOTE: the latest occurrence of a repeating suffix
    overlaps it, so its continuation runs into the tokens being drafted: they are read
    from the draft itself (a period of p tokens repeats), not cut short."""
    draft = tokens[start : start + count]
    period = len(tokens) - start
    while len(draft) < count:
        draft.append(draft[len(draft) - period] if len(draft) >= period else tokens[start + len(draft)])
    return draft


@register("drafter", "ngram")
class NgramDrafter(Drafter):
    def __init__(self, ngram_min: int = 2, ngram_max: int = 4, **options: Any) -> None:
        super().__init__(**options)
        self.lengths = range(ngram_max, ngram_min - 1, -1)  # longest first
        self._index: dict[str, _Index] = {}

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        tokens = req.prompt_ids + req.output_ids
        if self.cached is not None and (known := self.cached(tokens, req.namespace, max_tokens)):
            return known
        index = self._index.get(req.rid)
        if index is None or index.indexed >= len(tokens):  # new, or a reused id: start over
            index = self._index[req.rid] = _Index(self.lengths)
        index.extend(tokens)
        for n in self.lengths:
            if len(tokens) <= n:
                continue
            start = index.after[n].get(tuple(tokens[-n:]))
            if start is not None:
                return _continue(tokens, start, max_tokens)
        return []

    def forget(self, req: Request) -> None:
        self._index.pop(req.rid, None)
