"""`speculative.method: ngram` (prompt lookup): first what the radix tree holds right after
the request's tokens (the same prefix computed before: a repeated prompt, `n` > 1, a
retry); else the longest suffix of the request's tokens, ngram_max down to ngram_min
long, that occurred before in its prompt or output proposes the tokens that followed its
latest earlier occurrence; else what followed that suffix in other sequences the radix
tree holds (cache/radix_ngrams.py: the latest one inserted, same namespace). With topk > 1
(a token tree), the other tokens that followed the same suffix at earlier occurrences
(most recent first, longest suffix first) start side branches beside it, each continued
like the main one for half its length."""

from __future__ import annotations

from typing import Any

from kernel.registry import register
from kernel.request import Request
from kernel.speculative.drafter import Drafter
from kernel.speculative.tree import DraftTree


class _Index:
    """Per request: for each n-gram length, the n-gram -> per token that followed it, the
    position right after its latest occurrence followed by that token, latest last. Grows
    as tokens are appended (tokens never change once known; a retracted request keeps its
    tokens)."""

    def __init__(self, lengths: range) -> None:
        self.lengths = lengths
        self.after: dict[int, dict[tuple[int, ...], dict[int, int]]] = {n: {} for n in lengths}
        self.indexed = 0  # n-grams ending before this position are in `after`

    def extend(self, tokens: list[int]) -> None:
        # The n-gram ending at the last token has no token after it yet: indexed next time.
        for end in range(self.indexed + 1, len(tokens)):
            for n in self.lengths:
                if end >= n:
                    ends = self.after[n].setdefault(tuple(tokens[end - n : end]), {})
                    ends.pop(tokens[end], None)
                    ends[tokens[end]] = end  # latest last
        self.indexed = max(self.indexed, len(tokens) - 1)

    def starts(self, tokens: list[int]) -> list[int]:
        """Where continuations of the request's last tokens start: the latest occurrence of
        its longest indexed suffix first, then earlier ones with other next tokens."""
        out: list[int] = []
        seen: set[int] = set()
        for n in self.lengths:
            if len(tokens) <= n:
                continue
            for token, end in reversed(self.after[n].get(tuple(tokens[-n:]), {}).items()):
                if token not in seen:
                    seen.add(token)
                    out.append(end)
        return out


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
    reads_ngram_index = True

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4, **options: Any) -> None:
        super().__init__(**options)
        self.lengths = range(ngram_max, ngram_min - 1, -1)  # longest first
        self._index: dict[str, _Index] = {}
        self.elsewhere_drafts = 0  # drafts taken from other cached sequences

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        tokens = req.prompt_ids + req.output_ids
        return self._main(req, tokens, self._indexed(req, tokens).starts(tokens), max_tokens)

    def _main(self, req: Request, tokens: list[int], starts: list[int], max_tokens: int) -> list[int]:
        """The main draft: the tree's continuation, else the latest occurrence's, else another
        cached sequence's."""
        if self.cached is not None and (known := self.cached(tokens, req.namespace, max_tokens)):
            return known
        if starts:
            return _continue(tokens, starts[0], max_tokens)
        return self._elsewhere(req, tokens, max_tokens)

    def _elsewhere(self, req: Request, tokens: list[int], max_tokens: int) -> list[int]:
        """What followed the request's last n-gram in other cached sequences, longest first."""
        if self.anywhere is None:
            return []
        for n in self.lengths:
            if len(tokens) >= n and (found := self.anywhere(tokens[-n:], req.namespace, max_tokens)):
                self.elsewhere_drafts += 1
                return found
        return []

    def propose_tree(self, req: Request, depth: int, topk: int, rows: int) -> DraftTree:
        tokens = req.prompt_ids + req.output_ids
        starts = self._indexed(req, tokens).starts(tokens)
        main = self._main(req, tokens, starts, depth)
        if not main:
            return DraftTree(())
        draft, parents = list(main), list(range(-1, len(main) - 1))
        side = max(1, depth // 2)
        branches = 0
        for start in starts:
            if branches == topk - 1 or len(draft) >= rows:
                break
            if tokens[start] == main[0]:
                continue  # the main branch's first token (siblings differ)
            branch = _continue(tokens, start, min(side, rows - len(draft)))
            parents += [-1] + list(range(len(draft), len(draft) + len(branch) - 1))
            draft += branch
            branches += 1
        return DraftTree(tuple(draft), tuple(parents))

    def _indexed(self, req: Request, tokens: list[int]) -> _Index:
        index = self._index.get(req.rid)
        if index is None or index.indexed >= len(tokens):  # new, or a reused id: start over
            index = self._index[req.rid] = _Index(self.lengths)
        index.extend(tokens)
        return index

    def forget(self, req: Request) -> None:
        self._index.pop(req.rid, None)
