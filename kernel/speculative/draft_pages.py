"""Prefix hits for the draft model: which pages of its KV pool hold its KV of which tokens.

The draft's KV pool shares page ids with the target's (kernel/speculative/draft_model.py),
but only draft jobs write it, and a page the target computed or loaded back (another
request's prefill, a host or storage hit) may hold no draft KV, or the draft KV of other
tokens. So each page the draft wrote in full over a request's known tokens is marked
with the chained key of every token up to its end (the draft's KV there is a function of
exactly those); a request's first draft job starts after its leading pages whose marks
are its own keys, and every job re-marks what it writes: pages it fills with known
tokens get their key, pages it writes in part or with drafted tokens lose their mark.

NOTE: a wrong mark could only make drafts worse, never an output different (the target
verifies every draft): the marks are for speed, not for correctness.
"""

from __future__ import annotations

from kernel.request import Request


class DraftPages:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._marks: dict[int, int] = {}  # page id -> key of the tokens its draft KV covers
        self._keys: dict[str, list[int]] = {}  # per request: the chained key of each whole page

    def trusted(self, req: Request) -> int:
        """How many leading tokens of `req` the draft's KV already holds (whole pages)."""
        keys = self.keys(req, len(req.pages))
        n = 0
        while n < len(keys) and self._marks.get(req.pages[n]) == keys[n]:
            n += 1
        return n * self.page_size

    def written(self, req: Request, start: int, known: int, end: int) -> None:
        """A draft job for `req` writes its KV at positions [start, end); tokens before
        `known` are the request's own, the rest its drafts."""
        ps = self.page_size
        keys = self.keys(req, known // ps)
        for index in range(start // ps, min(-(-end // ps), len(req.pages))):
            if (index + 1) * ps <= known:
                self._marks[req.pages[index]] = keys[index]
            else:
                self._marks.pop(req.pages[index], None)

    def forget(self, req: Request) -> None:
        self._keys.pop(req.rid, None)

    def keys(self, req: Request, pages: int) -> list[int]:
        """The chained keys of `req`'s first `pages` whole pages of known tokens (grown as
        needed: a request's tokens never change once known)."""
        keys = self._keys.setdefault(req.rid, [])
        pages = min(pages, req.total_len // self.page_size)
        ps = self.page_size
        while len(keys) < pages:
            i = len(keys)
            keys.append(hash((keys[-1] if keys else 0, tuple(req.token_slice(i * ps, (i + 1) * ps)))))
        return keys[:pages]
