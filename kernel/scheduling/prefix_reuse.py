"""Prefix reuse as the scheduler sees it: the one place that turns a request into prefix
cache calls (cache/prefix_cache.py) and writes the results back into request fields.

NOTE: page ownership (invariant 3). A request's `pages` list is its KV in order; the
first `req.shared_pages` of them belong to the cache (shared, kept alive by the lock on
`req.cache_handle`), the rest belong to the request alone and are freed by it exactly
once. free + cached pages + request-owned pages == all usable pages, at every step.
"""

from __future__ import annotations

from cache.allocator import PageAllocator
from cache.prefix_cache import MatchResult, PrefixCache
from cache.req_table import ReqToTokenTable
from kernel.request import Request
from kernel.scheduling.prompt_logprobs import match_cap
from kernel.tiers.host_tier import HostTier


class PrefixReuse:
    """Match on admission, cache computed pages after every prefill chunk, release on
    finish/abort/retraction/error. Owns the engine-wide hit counters (in tokens)."""

    def __init__(
        self, cache: PrefixCache, allocator: PageAllocator, req_table: ReqToTokenTable, hybrid: bool = False
    ) -> None:
        self.cache = cache
        self.allocator = allocator
        self.req_table = req_table
        self.page_size = cache.page_size
        # Hybrid models insert only at checkpoints, with the state slot for exactly that
        # length (`cache_checkpoint`); dense models insert every computed whole page.
        self.hybrid = hybrid
        self.query_tokens = 0  # prompt tokens looked up on admission
        self.hit_tokens = 0  # of which served from the cache
        self.truncated_tokens = 0  # cached KV a hit could not use: no state at its end
        self.host: HostTier | None = None  # the host tier, when hicache is on
        # Overlap scheduling: duplicate pages a step in flight may still read through the
        # request's old row mapping; freed once that step has landed (`free_deferred`).
        self.deferred: list[int] = []

    @property
    def reuses(self) -> bool:
        return self.cache.reuses

    @property
    def evictable_pages(self) -> int:
        return self.cache.evictable_pages

    def evict(self, num_pages: int) -> None:
        self.cache.evict(num_pages)

    def probe(self, req: Request) -> MatchResult:
        """The cached prefix of `req` without using, locking or counting it."""
        return self.cache.match(self._matchable(req), req.namespace, touch=False)

    def match(self, req: Request) -> None:
        """On admission, before any page is allocated: reuse the longest cached prefix."""
        assert not req.pages and req.row is not None and req.cache_handle is None
        result = self.cache.match(self._matchable(req), req.namespace, priority=req.priority)
        # Prompt tokens served from the cache (what usage reports; a readmitted request
        # may also resume tokens it generated itself before its retraction).
        req.cached_tokens = min(result.length, len(req.prompt_ids))
        req.cached_by_tier = {"device": req.cached_tokens, "host": 0, "storage": 0}
        self.truncated_tokens += result.lost_tokens
        if result.length:
            self.cache.lock(result.node)
            req.resume_slot = result.state_slot  # lent, kept alive by the lock
            req.cache_handle = result.node
            req.pages = list(result.pages)
            req.shared_pages = len(result.pages)
            req.kv_len = result.length
            self.req_table.write_pages(req.row, 0, req.pages, self.page_size)
        if self.host is not None and result.host_length:  # the rest of the prefix is on host
            req.host_wait = not self.host.start_load(req, result)

    def storage_wait(self, req: Request) -> bool:
        """Before admission: whether `req` waits while its prefix comes in from storage
        (the first call probes storage past what the tree holds; see kernel/tiers/storage_tier.py)."""
        storage = self.host.storage if self.host is not None else None
        if storage is None or req.audit:
            return False

        def matched_pages() -> int:  # on any tier; hybrid: also KV whose state is not cached
            return self.probe(req).kv_length // self.page_size

        return storage.wait(req, lambda: self._matchable(req), matched_pages)

    def count_admission(self, req: Request) -> None:
        """Count an admission whose first chunk is planned (a refused one is not; an
        audit replay is no served traffic)."""
        if req.audit:
            return
        self.query_tokens += req.total_len
        self.hit_tokens += req.kv_len

    def _matchable(self, req: Request) -> list[int]:
        if req.audit:  # NOTE: a replay must run cold, or it would check the cache against itself
            return []
        # At least one token must be computed to sample from: cap below the last token.
        usable = req.total_len - 1
        cap = match_cap(req)
        if cap is not None:  # NOTE: scored prompt positions are computed, never matched
            usable = min(usable, cap)
        usable = usable // self.page_size * self.page_size
        return req.token_slice(0, usable)

    def cache_computed(self, req: Request) -> None:
        """Offer the request's computed whole pages to the cache; the request then points
        at the cache's copy of any page the cache already had, and frees its own."""
        full = req.kv_len // self.page_size
        if not self.cache.reuses or self.hybrid or full <= req.shared_pages:
            return
        self._insert(req, full, None)

    def cache_checkpoint(self, req: Request, state_slot: int, length: int) -> bool:
        """Hybrid models: cache the request's first `length` tokens (on the checkpoint
        grid, so whole pages; at most kv_len) with the state slot that covers exactly
        them. True if the cache took the slot; False if it already had a state there
        (the slot stays ours)."""
        assert length % self.page_size == 0 and length <= req.kv_len, "a checkpoint off the page grid"
        return self._insert(req, length // self.page_size, state_slot)

    def _insert(self, req: Request, full: int, state_slot: int | None) -> bool:
        assert req.row is not None, f"request {req.rid} reached the prefix cache without its table row"
        if req.audit:  # a replay leaves the cache as it found it: its pages stay its own
            return False
        mine = req.pages[:full]
        tokens = req.token_slice(0, full * self.page_size)
        result = self.cache.insert(tokens, mine, req.namespace, req.priority, state_slot=state_slot)
        dupes = result.duplicates(mine)
        if dupes:
            # Another request cached the same pages first: point at the cache's copy and
            # free ours (they are ours alone, so exactly once).
            req.pages[:full] = result.pages
            self.req_table.write_pages(req.row, 0, req.pages[:full], self.page_size)
            if req.inflight:
                # NOTE: a look-ahead step that has this request may have read the row
                # before the rewrite; a page freed now could be refilled (a host-tier
                # load) while it still reads it.
                self.deferred += dupes
            else:
                self.allocator.free(dupes)
        self.cache.lock(result.node)
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
        req.cache_handle = result.node
        req.shared_pages = full
        if self.host is not None:
            self.host.after_insert(result.node)
        return state_slot is not None and result.duplicate_state is None

    def free_deferred(self) -> None:
        """A step has landed (or failed): free the duplicates deferred while it ran."""
        if self.deferred:
            self.allocator.free(self.deferred)
            self.deferred = []

    def release(self, req: Request) -> None:
        """Give back every page the request owns; computed whole pages stay cached
        (not after a failed step: its KV may be incomplete)."""
        if self.host is not None:
            self.host.detach(req)
        if req.row is not None and req.error is None:
            self.cache_computed(req)
        self.allocator.free(req.pages[req.shared_pages :])
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
        req.pages, req.shared_pages, req.cache_handle = [], 0, None
