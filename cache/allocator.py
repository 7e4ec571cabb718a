"""Page allocator: a free list of KV page ids. Page 0 is reserved (padding target)."""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens (the one ceiling division of the project)."""
    return -(-num_tokens // page_size)


class OutOfPages(RuntimeError):
    """Raised only when a caller ignored `can_allocate`; the scheduler never does."""


class PageAllocator:
    """Hands out page ids from a free list.

    Contract: ids are in [1, num_pages); page 0 is never handed out because padding rows
    of static-shape batches write there. `free` of a page that is not allocated raises,
    so a double free is caught where it happens rather than as a leak later.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("need at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        # Pop from the end: low ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._allocated:
                raise RuntimeError(f"page {page} freed but not allocated (double free?)")
            self._allocated.remove(page)
            self._free.append(page)
