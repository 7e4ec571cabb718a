"""The host tier as the scheduler sees it (dense and hybrid models): cached device pages
get host copies in the background (a write policy decides which), and a request whose
prefix is on host waits — as its prefetch policy allows — while a copy job loads it back.
Hybrid models' state slots never move: they stay in the state pool with their node, so
a request attached to a loaded host part resumes from the host node's slot (`_attach`).

Copies run on the copy worker (cache/copy_worker.py), never on the event loop and never
queued behind forwards (on CUDA on the worker's copy stream: a forward's KV is complete
before its pages are offered for copying, because a step's results come back only after
its device work completed (gpu/readback.py), and a load's pages are complete before the request
reads them, because the worker waits for its stream before the load's future resolves); their completions come back here, on the loop, which owns the
tree. NOTE: invariant 3 with tiers. A node being copied is locked (it cannot be evicted
or lose its pages); device pages a load fills belong to the load until the tree takes
them (`restore`), host pages a copy fills belong to the copy until `mark_host`; the
scheduler's accounting counts both (`held_pages`, `check`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from cache.allocator import PageAllocator
from cache.copy_worker import CopyWorker
from cache.host_pool import HostPool, load_back, offload
from cache.kv_pool import KVPool
from cache.prefix_cache import MatchResult, PrefixCache
from cache.req_table import ReqToTokenTable
from kernel.request import Request
from kernel.tiers.storage_tier import StorageTier
from kernel.tiers.tier_policy import PrefetchPolicy, WritePolicy

log = structlog.get_logger("tierserve")


class RankCopies(Protocol):
    """Tensor parallelism: the other ranks' side of each copy (kernel/parallel/host_shards.py).
    Every rank holds its shard of a page, under the same device and host page ids."""

    def post(self, kind: str, src: list[int], dst: list[int]) -> int:
        """Queue the same copy ("offload": device pages `src` to host pages `dst`, "load":
        host to device) on every other rank, in order with the steps; its ticket."""
        ...

    def wait(self, ticket: int) -> None:
        """Block until every other rank finished the copy `ticket` (and all before it);
        raise if one cannot (a dead rank, shutdown, `parallel.timeout_s`)."""
        ...


@dataclass(eq=False)
class Load:
    """One load-back in flight: host pages of `host_node`'s path into `device_pages`."""

    req: Request | None  # the request waiting for it (None once it stopped waiting)
    host_node: Any
    device_pages: list[int]
    host_tokens: int
    deadline: float


@dataclass
class TierCounters:
    offloaded_pages: int = 0
    loaded_pages: int = 0
    host_hit_tokens: int = 0
    prefetch: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("issued", "completed", "revoked", "timed_out", "skipped"), 0))
    failures: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("host_full", "copy", "copy_revoked", "load"), 0)
    )


class HostTier:
    def __init__(
        self, tree: PrefixCache, kv_pool: KVPool, host_pool: HostPool, worker: CopyWorker,
        write: WritePolicy, prefetch: PrefetchPolicy, allocator: PageAllocator, req_table: ReqToTokenTable,
        headroom: float = 0.125,
    ) -> None:
        self.tree = tree
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.worker = worker
        self.write = write
        self.prefetch = prefetch
        self.allocator = allocator
        self.req_table = req_table
        self.page_size = tree.page_size
        self.copying: dict[int, list[int]] = {}  # id(node) -> host pages being written
        self.loads: list[Load] = []
        self.counters = TierCounters()
        self.wake: Callable[[], None] = lambda: None  # the step loop's, set by the engine
        self.storage: StorageTier | None = None  # the tier below, when hicache.storage is set
        self.headroom = headroom  # write_back: free-page fraction below which victims are copied
        # Hybrid models with storage: whether a state slot still waits for a queued copy
        # (set by the engine); nodes deferred for that, by id.
        self.state_pending: Callable[[int], bool] = lambda slot: False
        self.deferred: dict[int, Any] = {}
        # NOTE: with tensor parallelism a copy is done (its future resolves) only once every
        # rank's shard of it landed: storage then reads whole pages, and a step planned after
        # it finds every rank's pages in place.
        self.ranks: RankCopies | None = None

    # ---- offload ------------------------------------------------------------------
    def after_insert(self, node: Any) -> None:
        """A request cached up to `node`: copy what the write policy wants on its path."""
        while node is not None and node.parent is not None:
            if self._fresh(node) and self.write.should_copy(node.hit_count):
                self._copy_when_ready(node)
            node = node.parent

    def _fresh(self, node: Any) -> bool:
        return bool(node.parent is not None and node.pages and node.host_pages is None and id(node) not in self.copying)

    def _copy_when_ready(self, node: Any) -> None:
        # NOTE: a hybrid node's state slot may still wait for its copy from the live state
        # (queued for the device thread: HybridState.copies). Storage would read it stale,
        # so its copy waits until that ran (`copy_deferred`, before the next plan).
        if self.storage is not None and node.state_slot is not None and self.state_pending(node.state_slot):
            self.deferred[id(node)] = node
        else:
            self._copy(node)

    def copy_deferred(self) -> None:
        """Copy the nodes that waited for their state slot (still cached and uncopied)."""
        waiting, self.deferred = list(self.deferred.values()), {}
        for node in waiting:
            if self._fresh(node) and node.state_slot is not None:
                self._copy_when_ready(node)

    def before_plan(self) -> None:
        """Before each plan: deferred copies whose states have landed, write-back, then
        storage writes that were missed."""
        if self.deferred:
            self.copy_deferred()
        self.write_back()
        if self.storage is not None and self.storage.backlog:
            self.storage.backfill()

    def write_back(self) -> None:
        """Write-back policies: when free device pages are short, copy the nodes eviction
        would take next, so that they move to host instead of being dropped. A node being
        copied is locked: it is evicted after its copy landed."""
        if not self.write.on_evict:
            return
        want = int(self.headroom * self.allocator.num_usable) - self.allocator.num_free
        if want <= 0:
            return
        for node in self.tree.next_victims(want):
            if self._fresh(node):
                self._copy_when_ready(node)

    def _copy(self, node: Any) -> None:
        pages = list(node.pages)
        host = self.host_pool.allocate(len(pages))
        if host is None:
            self.tree.evict_host(len(pages) - self.host_pool.num_free)
            host = self.host_pool.allocate(len(pages))
        if host is None:
            self.counters.failures["host_full"] += 1
            return
        self.tree.lock(node)  # not evicted, and its pages not reused, while they are read
        self.copying[id(node)] = host
        # The storage write carries the page bytes, read by the copy job while the copy owns
        # the host pages: a queued write then depends on nothing the tree may evict meanwhile.
        capture = self.storage.capture(node, host) if self.storage is not None else None
        items: list[tuple[str, bytes]] = []
        ranks = self.ranks
        ticket = ranks.post("offload", pages, host) if ranks is not None else 0

        def job() -> int:
            stream = self.worker.stream
            copied = offload(self.kv_pool, pages, self.host_pool, host, stream)  # type: ignore[arg-type]
            if ranks is not None:
                ranks.wait(ticket)
            if capture is not None:
                # NOTE: on CUDA `offload` only queued the copies into the host pages (pinned,
                # non-blocking): storage reads those pages, so they must have landed first.
                # (The worker's own wait comes after the job, too late for this read.)
                if stream is not None:
                    stream.synchronize()
                items.extend(capture())
            return copied

        fut = self.worker.submit_copy(job)
        fut.add_done_callback(lambda f: self._copied(node, pages, host, f, items))

    def _copied(
        self, node: Any, pages: list[int], host: list[int], fut: asyncio.Future[int], items: list[tuple[str, bytes]],
    ) -> None:
        del self.copying[id(node)]
        ok = not fut.cancelled() and fut.exception() is None
        # A match that split the node meanwhile changed what it holds: this copy no longer
        # names one node; drop it (a later insert copies the parts).
        if ok and node.pages == pages and node.host_pages is None:
            self.tree.mark_host(node, host)
            self.counters.offloaded_pages += len(pages)
            if items and self.storage is not None:
                self.storage.write(node, items)
        else:
            self.host_pool.free(host)
            self.counters.failures["copy" if not ok else "copy_revoked"] += 1
            if not ok and not fut.cancelled():  # a bug or a shutdown, never a race: say which
                log.warning("host_copy_failed", error=repr(fut.exception()))
        self.tree.unlock(node)

    # ---- load back ------------------------------------------------------------------
    def start_load(self, req: Request, match: MatchResult) -> bool:
        """After `req` matched `match` (its device part locked): load the host part back.
        False when it cannot start now — no device pages for it, or another request is
        loading the same prefix: the request then waits for admission (computing the
        part itself would need the same pages, and the other load serves it soon)."""
        n = len(match.host_pages)
        if n == 0:
            return True
        if any(load.host_node is match.host_node for load in self.loads):
            return False
        if not self.allocator.can_allocate(n):
            self.tree.evict(n - self.allocator.num_free)
        if not self.allocator.can_allocate(n):
            return False
        device = self.allocator.allocate(n)
        assert match.host_node is not None
        self.tree.lock(match.host_node)  # its host copies stay while they are read
        budget = self.prefetch.budget_s(match.host_length)
        load = Load(req if budget > 0 else None, match.host_node, device, match.host_length,
                    time.monotonic() + budget)
        self.loads.append(load)
        req.loading = load if budget > 0 else None
        host_pages = list(match.host_pages)
        stream = self.worker.stream
        ranks = self.ranks
        ticket = ranks.post("load", host_pages, device) if ranks is not None else 0

        def job() -> int:
            copied = load_back(self.host_pool, host_pages, self.kv_pool, device, stream)  # type: ignore[arg-type]
            if ranks is not None:
                ranks.wait(ticket)
            return copied

        # Urgent: a request waits for it, so it starts before offloads still queued.
        fut = self.worker.submit_copy(job, urgent=True)
        fut.add_done_callback(lambda f: self._loaded(load, f))
        self.counters.prefetch["issued"] += 1
        return True

    def expire(self, req: Request) -> None:
        """Planning: a request past its prefetch budget computes the rest itself."""
        load = req.loading
        if isinstance(load, Load) and time.monotonic() >= load.deadline:
            load.req, req.loading = None, None
            self.counters.prefetch["timed_out"] += 1

    def detach(self, req: Request) -> None:
        """The request leaves (finish, abort, retraction) while its load is in flight: the
        load completes into the tree for later requests."""
        load = req.loading
        if isinstance(load, Load):
            load.req, req.loading = None, None

    def _loaded(self, load: Load, fut: asyncio.Future[int]) -> None:
        self.loads.remove(load)
        req = load.req
        if fut.cancelled() or fut.exception() is not None:
            self.allocator.free(load.device_pages)
            self.counters.failures["load"] += 1
        else:
            try:
                self.tree.restore(load.host_node, load.device_pages)
            except ValueError:  # an insert gave these nodes device pages meanwhile
                self.allocator.free(load.device_pages)
                self.counters.prefetch["revoked"] += 1
            else:
                self.counters.loaded_pages += len(load.device_pages)
                self.counters.prefetch["completed"] += 1
                if req is not None and req.loading is load and not req.finished and req.row is not None:
                    self._attach(req, load)
        self.tree.unlock(load.host_node)
        if req is not None and req.loading is load:
            req.loading = None
        self.wake()

    def _attach(self, req: Request, load: Load) -> None:
        """The request now reads the loaded pages as cached ones, like a device hit."""
        assert req.row is not None
        start = len(req.pages)
        assert start == req.shared_pages and req.kv_len == start * self.page_size
        req.pages.extend(load.device_pages)
        req.shared_pages = len(req.pages)
        req.kv_len += load.host_tokens
        # NOTE: invariant 2 across tiers. A hybrid request resumes from the state after
        # exactly the loaded prefix: the host part ends at a node holding that slot
        # (cache/radix_tree.py `match`), lent like its pages and kept by the lock taken
        # below. Until here (a load that failed, was revoked or outlived the request's
        # budget) it resumes from its device part's slot. Dense trees: None, unread.
        req.resume_slot = load.host_node.state_slot
        self.req_table.write_pages(req.row, start, load.device_pages, self.page_size)
        self.tree.lock(load.host_node)
        if req.cache_handle is not None:
            self.tree.unlock(req.cache_handle)
        req.cache_handle = load.host_node
        used = min(load.host_tokens, max(len(req.prompt_ids) - req.cached_tokens, 0))
        # Tokens this request's own storage fetch brought into the host tier count as storage hits.
        from_storage = self.storage.split_hit(req, start * self.page_size, used) if self.storage is not None else 0
        req.cached_by_tier["host"] = used - from_storage
        req.cached_by_tier["storage"] = from_storage
        req.cached_tokens += used
        self.counters.host_hit_tokens += load.host_tokens - from_storage

    # ---- accounting -----------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.copying or self.loads) or (self.storage is not None and self.storage.busy)

    def held_pages(self) -> list[int]:
        """Device pages loads in flight fill (owned by the load until the tree takes them)."""
        return [p for load in self.loads for p in load.device_pages]

    def held_host_pages(self) -> list[int]:
        """Host pages copies (and storage fetches) in flight fill: theirs until the tree takes them."""
        held = [p for pages in self.copying.values() for p in pages]
        return held + self.storage.held_host_pages() if self.storage is not None else held

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "host_pages": {"usable": self.host_pool.num_usable, "free": self.host_pool.num_free,
                           "cached": self.tree.total_host_pages, "copying": len(self.held_host_pages())},
            "offloaded_pages": c.offloaded_pages, "loaded_pages": c.loaded_pages,
            "offloaded_bytes": c.offloaded_pages * self.host_pool.bytes_per_page,
            "loaded_bytes": c.loaded_pages * self.host_pool.bytes_per_page,
            "host_hit_tokens": c.host_hit_tokens, "prefetch": dict(c.prefetch), "failures": dict(c.failures),
        }
