"""Free lists of ids (KV pages, state slots, host pages); id 0 is always reserved."""

from __future__ import annotations

from collections.abc import Sequence


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens (the one ceiling division of the project)."""
    return -(-num_tokens // page_size)


class FreeList:
    """Ids [1, size) from a free list; id 0 is reserved (the padding target of static-shape
    batches) and never handed out. The one free list of the project: KV pages, state
    slots, host pages and host state slots all count through it.

    A free of an id that is not allocated (or repeated) raises and changes nothing, so a
    double free is caught where it happens rather than as a leak later.
    """

    def __init__(self, size: int, what: str) -> None:
        if size < 2:
            raise ValueError(f"a pool of {what}s needs at least 2 ({what} 0 is reserved), got {size}")
        self.size = size
        self.what = what
        # Pop from the end: low ids first (readable tests; consecutive runs copy in one go).
        self._free: list[int] = list(range(size - 1, 0, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.size - 1

    def allocate(self, n: int) -> list[int] | None:
        """`n` ids, or None (and nothing taken) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} {self.what}s")
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._allocated.update(ids)
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Return `ids`; raises (changing nothing) if any is reserved, not allocated or repeated."""
        if len(set(ids)) != len(ids):
            raise RuntimeError(f"{self.what}s {list(ids)} contain a repeat (double free)")
        for i in ids:
            if not 0 < i < self.size:
                raise RuntimeError(f"{self.what} {i} is reserved or out of range [1, {self.size})")
            if i not in self._allocated:
                raise RuntimeError(f"{self.what} {i} freed twice or never allocated (double free?)")
        self._allocated.difference_update(ids)
        # Highest first, so the next allocations pop them lowest first: freed runs of
        # consecutive ids come back as ascending runs (a host-tier copy moves each run in
        # one transfer; freed in the order given they would come back reversed, one page
        # per transfer).
        self._free.extend(sorted(ids, reverse=True))

    def is_allocated(self, i: int) -> bool:
        return i in self._allocated


class PooledIds:
    """The counting face of a pool whose ids come from `self._ids` (a FreeList)."""

    _ids: FreeList

    @property
    def num_free(self) -> int:
        return self._ids.num_free

    @property
    def num_usable(self) -> int:
        return self._ids.num_usable

    def is_allocated(self, i: int) -> bool:
        return self._ids.is_allocated(i)


class OutOfPages(RuntimeError):
    """Raised only when a caller ignored `can_allocate`; the scheduler never does."""


class PageAllocator(FreeList):
    """KV page ids: page 0 is never handed out because padding rows write there."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages, "page")
        self.num_pages = num_pages

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        pages = super().allocate(n)
        if pages is None:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free")
        return pages
