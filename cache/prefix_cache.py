"""Prefix reuse as the scheduler sees it: match on admission, cache computed pages,
release on finish/abort/retraction. `none` disables reuse; `radix` uses the radix tree.

NOTE: page ownership (invariant 3). A request's `pages` list is its KV in order; the
first `req.tree_pages` of them belong to the tree (shared, kept alive by the lock on
`req.node`), the rest belong to the request alone and are freed by it exactly once.
free + tree pages + request-owned pages == all usable pages, at every step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from cache.allocator import PageAllocator
from cache.evict_policy import EvictPolicy
from cache.radix_node import TreeNode
from cache.radix_tree import RadixTree
from cache.req_table import ReqToTokenTable
from kernel.request import Request


class PrefixCache(ABC):
    """Contract: `match` runs once per admission, before any page is allocated for the
    request, and may set `kv_len`/`pages`; `cache_computed` may replace duplicate pages
    with the tree's; `release` returns everything the request owns. None of them may
    change the tokens a request will compute, only where their KV lives."""

    reuses = False  # whether a request can ever start from cached KV

    def __init__(self, allocator: PageAllocator, req_table: ReqToTokenTable, page_size: int) -> None:
        self.allocator = allocator
        self.req_table = req_table
        self.page_size = page_size
        self.query_tokens = 0  # prompt tokens looked up (engine-wide counter)
        self.hit_tokens = 0  # of which served from the cache

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def tree_pages(self) -> int:
        return 0

    def evict(self, num_pages: int) -> None:
        """Free at least `num_pages` cached pages if possible."""

    def match(self, req: Request) -> None:
        """Reuse the longest cached prefix of `req` (none here)."""

    def probe(self, req: Request) -> tuple[int, TreeNode | None]:
        """Cached prefix length (and its node) of `req`, without using or counting it."""
        return 0, None

    def cache_computed(self, req: Request) -> None:
        """Offer the request's computed whole pages to the cache (nothing here)."""

    @abstractmethod
    def release(self, req: Request) -> None:
        """Give back every page the request owns; afterwards it holds none."""

    def reset(self) -> None:
        """Drop everything cached (only when no request holds a cached node)."""

    def check_integrity(self) -> None:
        """Raise AssertionError if the cache's own bookkeeping is broken."""


class NoPrefixCache(PrefixCache):
    def release(self, req: Request) -> None:
        self.allocator.free(req.pages)
        req.pages = []


class RadixPrefixCache(PrefixCache):
    reuses = True

    def __init__(
        self, allocator: PageAllocator, req_table: ReqToTokenTable, page_size: int, policy: EvictPolicy
    ) -> None:
        super().__init__(allocator, req_table, page_size)
        self.tree = RadixTree(page_size, allocator.free, policy)

    @property
    def evictable_pages(self) -> int:
        return self.tree.evictable_pages

    @property
    def tree_pages(self) -> int:
        return self.tree.total_pages

    def evict(self, num_pages: int) -> None:
        self.tree.evict(num_pages)

    def probe(self, req: Request) -> tuple[int, TreeNode | None]:
        result = self.tree.match(self._matchable(req), req.namespace, touch=False)
        return result.length, result.node

    def match(self, req: Request) -> None:
        assert not req.pages and req.row is not None and req.node is None
        result = self.tree.match(self._matchable(req), req.namespace, priority=req.priority)
        req.cached_tokens = result.length
        if result.length == 0:
            return
        self.tree.lock(result.node)
        req.node = result.node
        req.pages = list(result.pages)
        req.tree_pages = len(result.pages)
        req.kv_len = result.length
        self.req_table.write_pages(req.row, 0, req.pages, self.page_size)

    def _matchable(self, req: Request) -> list[int]:
        # At least one token must be computed to sample from: cap below the last token.
        usable = (req.total_len - 1) // self.page_size * self.page_size
        return req.token_slice(0, usable)

    def cache_computed(self, req: Request) -> None:
        full = req.kv_len // self.page_size
        if full <= req.tree_pages:
            return
        assert req.row is not None
        mine = req.pages[:full]
        result = self.tree.insert(req.token_slice(0, full * self.page_size), mine, req.namespace, req.priority)
        dupes = result.duplicates(mine)
        if dupes:
            # Another request cached the same pages first: point at the tree's copy and
            # free ours (they are ours alone, so exactly once).
            req.pages[:full] = result.pages
            self.req_table.write_pages(req.row, 0, req.pages[:full], self.page_size)
            self.allocator.free(dupes)
        self.tree.lock(result.node)
        if req.node is not None:
            self.tree.unlock(req.node)
        req.node = result.node
        req.tree_pages = full

    def release(self, req: Request) -> None:
        if req.row is not None and req.error is None:
            self.cache_computed(req)
        self.allocator.free(req.pages[req.tree_pages :])
        if req.node is not None:
            self.tree.unlock(req.node)
        req.pages, req.tree_pages, req.node = [], 0, None

    def reset(self) -> None:
        self.tree.reset()

    def check_integrity(self) -> None:
        self.tree.check_integrity()
