"""The storage tier as the scheduler sees it: below the host tier, host copies are also
written to a storage backend (cache/storage/, registry kind `storage`), and a request
whose prefix is in storage but not in the tree has it fetched into host pages before it
is admitted — from there the host tier loads it back like any host hit.

Hybrid models: a node's recurrent state is written with its last page, under that page's
chained hash in a state format (it is only valid at exactly that position); a fetch
stops at the deepest page that has one, and the state comes back into a state slot the
new host-only node takes.

Storage outlives the process and may be shared by servers (redis), so the tree does not
know what it holds: a request probes it (`exists_prefix` over the chained keys of its
pages past what the tree matched) once, before admission, and waits — as long as the
prefetch policy allows and at most `hicache.storage_timeout_s` — while the fetch runs.

NOTE: storage I/O never runs on the event loop or on the copy worker: reads run in a
small thread pool (a slow read must not hold up others), writes on their own FIFO
worker. Their completions come back here, on the loop, which owns the tree and the host
pool. A fetch owns the host pages it fills until `insert_host` takes them (counted by the
scheduler's integrity check); a write carries bytes taken at copy time, so it holds
nothing of the tree's. Anything that goes wrong — a missing, truncated, corrupt or late
page, a full disk, a dead server — only makes the tier serve less: the tokens past what
was served are computed, so outputs do not change. A backend whose operations keep
failing (`storage_fail_limit` in a row) is switched off, with a log line, until the
admin socket switches it back on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from cache.copy_worker import CopyWorker
from cache.host_pool import HostPool
from cache.kv_events import page_hashes
from cache.prefix_cache import PrefixCache
from cache.state_pool import StatePool
from cache.storage import PageFormat, StorageBackend, keys_for_hashes
from kernel.request import Request
from kernel.tiers.storage_io import StateBytes, checked_call, fill, probe
from kernel.tiers.tier_policy import PrefetchPolicy

log = structlog.get_logger("tierserve")

STATS_MAX_AGE_S = 1.0
MAX_PROBES = 3  # storage checks per request (the first, and re-checks after an eviction)
BACKLOG_MAX_NODES = 4096  # missed writes remembered for `backfill`
BACKFILL_PAGES = 16  # pages `backfill` reads and queues per plan (host memory copies on the loop)


@dataclass(eq=False)
class Fetch:
    """One storage fetch in flight: the pages of `tokens` from page `first` on."""

    req: Request | None  # the request waiting for it (None once it stopped waiting)
    tokens: list[int]  # the request's matchable tokens (whole pages)
    namespace: str | None
    first: int  # pages the tree matched when the fetch started
    keys: list[str]  # storage keys of pages first, first + 1, ...
    state_keys: list[str]  # hybrid: keys of the states after those pages ([] for dense models)
    deadline: float
    host_pages: list[int] = field(default_factory=list)  # filled by the read; the fetch's own
    state_slot: int | None = None  # hybrid: the state slot the read fills; the fetch's own


@dataclass
class StorageTierCounters:
    hit_tokens: int = 0
    written_pages: int = 0
    backfilled_pages: int = 0  # queued again from host copies after a missed write
    written_bytes: int = 0
    read_pages: int = 0
    read_bytes: int = 0
    switched_off: int = 0
    prefetch: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("issued", "completed", "revoked", "timed_out", "empty"), 0))
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("timeout", "error", "host_full", "states_full", "queue_full", "bad_page"), 0))


class StorageTier:
    def __init__(
        self, backend: StorageBackend, fmt: PageFormat, tree: PrefixCache, host_pool: HostPool,
        prefetch: PrefetchPolicy, options: Mapping[str, Any], states: StatePool | None = None,
        grid_pages: int = 1, state_bytes: StateBytes | None = None,
    ) -> None:
        self.backend = backend
        self.fmt = fmt
        self.states = states  # hybrid models: the state pool states are read from and into
        self.grid_pages = grid_pages  # hybrid models: states exist only every this many pages
        # How a state slot's bytes are read and written (every rank's part, with tensor parallelism).
        self.state_bytes = state_bytes or (StateBytes(states) if states is not None else None)
        self.state_fmt = dataclasses.replace(fmt, layout=self.state_bytes.layout) if self.state_bytes else None
        self.tree = tree
        self.host_pool = host_pool
        self.prefetch = prefetch
        self.page_size = fmt.page_size
        self.timeout_s = float(options["storage_timeout_s"])
        self.fail_limit = int(options["storage_fail_limit"])
        self.queue_limit = int(options["storage_queue_bytes"])
        self.flush_timeout_s = float(options["storage_flush_timeout_s"])
        self.reader = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="tierserve-storage-read")
        self.writer = CopyWorker("tierserve-storage-write")
        self.enabled = True
        self.failing = 0  # operations failed in a row
        self.fetches: list[Fetch] = []
        self.writes = 0  # writes queued or running
        self.queued_bytes = 0
        self.counters = StorageTierCounters()
        self.wake: Callable[[], None] = lambda: None  # the step loop's, set by the engine
        # Host-tier nodes whose storage write did not happen (storage off, queue full, a
        # failed write): written later from their host pages (`backfill`), oldest first.
        self.backlog: dict[int, Any] = {}
        # NOTE: a backend's stats() may be slow (redis: a SCAN), and stats() runs on the
        # loop for every /metrics scrape: unless it is cheap, it is refreshed on a reader
        # thread, at most every STATS_MAX_AGE_S, and served from here.
        self.backend_stats: dict[str, Any] = backend.stats()
        self._stats_refreshing = False
        self._stats_time = time.monotonic()

    # ---- writes ---------------------------------------------------------------------
    def wants(self, node: Any) -> bool:
        """Whether a node getting a host copy should be written to storage too."""
        return self.enabled and not node.stored

    def capture(self, node: Any, host_pages: list[int]) -> Callable[[], list[tuple[str, bytes]]] | None:
        """For a host copy of `node` into `host_pages` starting now: None if storage does
        not want it, else a function for the copy worker to call once the copy is done,
        while the copy still owns the host pages (and the lock keeps the node's state
        slot): the (key, bytes) items to `write`. A queued write then holds nothing."""
        if not self.wants(node):
            if not node.stored:
                self.missed(node)
            return None
        return self._items(node, host_pages)

    def _items(self, node: Any, host_pages: list[int]) -> Callable[[], list[tuple[str, bytes]]]:
        keys = keys_for_hashes(node.hashes, self.fmt)
        slot = node.state_slot if self.state_bytes is not None else None
        state_key = keys_for_hashes([node.hash], self.state_fmt)[0] if slot is not None and self.state_fmt else None
        state = self.state_bytes.reader(slot) if self.state_bytes is not None and slot is not None else None

        def items() -> list[tuple[str, bytes]]:
            out = [(key, self.host_pool.page_bytes(page)) for key, page in zip(keys, host_pages, strict=True)]
            if state_key is not None and state is not None:
                out.append((state_key, state()))  # after its pages
            return out

        return items

    def write(self, node: Any, items: list[tuple[str, bytes]]) -> None:
        """Queue `node`'s captured items for storage (from the writer thread)."""
        size = sum(len(data) for _, data in items)
        if not self.enabled:
            self.missed(node)
            return
        if self.queued_bytes + size > self.queue_limit:
            self.counters.failures["queue_full"] += 1  # storage cannot keep up: skip, never block
            self.missed(node)
            return
        self.queued_bytes += size
        self.writes += 1
        hashes = set(node.hashes)  # now: a split meanwhile changes the node's
        fut = self.writer.submit(lambda: checked_call(lambda: self.backend.set_pages(items)))
        fut.add_done_callback(lambda f: self._written(node, hashes, len(items), size, f))

    def _written(self, node: Any, hashes: set[int], n: int, size: int, fut: asyncio.Future[Any]) -> None:
        self.queued_bytes -= size
        self.writes -= 1
        stored, ok = self._result(fut, 0)
        if stored == n and node.parent is not None and set(node.hashes) <= hashes:
            node.stored = True
        elif stored != n:
            self.missed(node)
        self.counters.written_pages += stored
        self.counters.written_bytes += size * stored // max(n, 1)
        self._outcome(ok and stored == n)

    def missed(self, node: Any) -> None:
        """Remember a node whose write did not happen; the oldest is forgotten when full."""
        self.backlog.pop(id(node), None)
        self.backlog[id(node)] = node
        if len(self.backlog) > BACKLOG_MAX_NODES:
            del self.backlog[next(iter(self.backlog))]

    def backfill(self) -> None:
        """Before a plan (on the loop): write missed nodes from the host copies they have
        now, at most BACKFILL_PAGES pages a call, while storage is on and keeps up.
        NOTE: the bytes are read here, synchronously, from host pages the tree owns (no
        eviction runs meanwhile), so the queued write depends on nothing the tree may free.
        A hybrid node's recurrent state lives in the device state pool, which the loop never
        reads: such nodes are not backfilled (their prefix is recomputed, still exact)."""
        pages = 0
        while self.backlog and self.enabled and not self.failing and pages < BACKFILL_PAGES:
            if 2 * self.queued_bytes > self.queue_limit:
                return  # the writer is behind: fresh writes first
            node = self.backlog.pop(next(iter(self.backlog)))
            host = node.host_pages
            if node.parent is None or node.stored or host is None or node.state_slot is not None:
                continue
            self.write(node, self._items(node, list(host))())
            self.counters.backfilled_pages += len(host)
            pages += len(host)

    # ---- fetches --------------------------------------------------------------------
    def wait(self, req: Request, tokens: Callable[[], list[int]], matched_pages: Callable[[], int]) -> bool:
        """Before admission: whether `req` waits for a storage fetch of its prefix. The
        first call for a request probes storage for its pages past `matched_pages()`
        (what the tree holds on any tier) and starts a fetch if there are some. Until its
        budget is spent, a later call probes again if the tree has lost part of what it
        held at the last check or what the fetch brought (evicted meanwhile: another
        fetch's host pages, say), at most MAX_PROBES times."""
        fetch = req.storage_fetch
        if isinstance(fetch, Fetch):
            if time.monotonic() < fetch.deadline:
                return True
            fetch.req, req.storage_fetch = None, None  # it computes; the fetch still lands
            self.counters.prefetch["timed_out"] += 1
            return False
        if not self.enabled or req.storage_probes >= MAX_PROBES:
            return False
        if req.storage_probes and time.monotonic() >= req.storage_deadline:
            return False
        first = matched_pages()
        if req.storage_probes and first >= req.storage_matched:
            return False  # the tree holds all it held: nothing to fetch again
        toks = tokens()
        req.storage_probes += 1
        req.storage_matched = first
        if len(toks) // self.page_size <= first:
            return False
        return self._start(req, toks, first)

    def _start(self, req: Request, tokens: list[int], first: int) -> bool:
        hashes = page_hashes(tokens, self.page_size, req.namespace)[first:]
        keys = keys_for_hashes(hashes, self.fmt)
        state_keys = keys_for_hashes(hashes, self.state_fmt) if self.state_fmt is not None else []
        budget = min(self.prefetch.budget_s(len(keys) * self.page_size), self.timeout_s)
        deadline = time.monotonic() + budget
        if req.storage_probes > 1:
            deadline = min(deadline, req.storage_deadline)  # one budget for all its probes
        req.storage_deadline = deadline
        fetch = Fetch(req if budget > 0 else None, tokens, req.namespace, first, keys, state_keys, deadline)
        req.storage_fetch = fetch if budget > 0 else None
        self.fetches.append(fetch)
        self.counters.prefetch["issued"] += 1
        fut = self._read(lambda: probe(self.backend, keys, state_keys, first, self.grid_pages))
        fut.add_done_callback(lambda f: self._probed(fetch, f))
        return fetch.req is not None

    def _read(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self.reader, checked_call, fn)

    def _probed(self, fetch: Fetch, fut: asyncio.Future[Any]) -> None:
        n, ok = self._result(fut, 0)
        self._outcome(ok)
        if n == 0 or not self.enabled:
            self._finish(fetch, "empty")
            return
        host = self._host_pages(n)
        if not host:
            self.counters.failures["host_full"] += 1
            self._finish(fetch, "empty")
            return
        fetch.host_pages = host
        keys = fetch.keys[: len(host)]
        state_key = None
        if fetch.state_keys:
            if len(host) < n or (slot := self._state_slot()) is None:
                self.counters.failures["states_full" if len(host) == n else "host_full"] += 1
                self.host_pool.free(host)
                fetch.host_pages = []
                self._finish(fetch, "empty")
                return
            fetch.state_slot, state_key = slot, fetch.state_keys[n - 1]
        slot = fetch.state_slot
        read = self._read(lambda: fill(self.backend, self.host_pool, self.state_bytes, keys, host, state_key, slot))
        read.add_done_callback(lambda f: self._filled(fetch, f))

    def _state_slot(self) -> int | None:
        """A free state slot for a hybrid fetch, evicting an unlocked cached one if needed."""
        assert self.states is not None
        slot = self.states.allocate()
        if slot is None and self.tree.evict_states(1):
            slot = self.states.allocate()
        return slot

    def _host_pages(self, n: int) -> list[int]:
        """Up to `n` host pages, evicting unlocked host copies for them if needed."""
        pool = self.host_pool
        if pool.num_free < n:
            self.tree.evict_host(n - pool.num_free)
        return pool.allocate(min(n, pool.num_free)) or []

    def _filled(self, fetch: Fetch, fut: asyncio.Future[Any]) -> None:
        (k, bad), ok = self._result(fut, (0, 0))
        self._outcome(ok)
        self.counters.failures["bad_page"] += bad
        host, fetch.host_pages = fetch.host_pages, []
        slot, fetch.state_slot = fetch.state_slot, None
        taken = 0
        if k:
            end = (fetch.first + k) * self.page_size
            if slot is not None and self.state_bytes is not None:
                self.state_bytes.commit(slot)  # before the tree lends the slot to anyone
            leaf, dupes = self.tree.insert_host(fetch.tokens[:end], host[:k], fetch.namespace, state_slot=slot)
            taken = k - len(dupes)
            if leaf is not None:
                slot = None  # the new node took it
            self.host_pool.free(dupes + host[k:])
            if fetch.req is not None and taken:
                fetch.req.storage_span = (end - taken * self.page_size, end)
                fetch.req.storage_matched = fetch.first + k  # what the tree holds for it now
            self.counters.read_pages += k
            self.counters.read_bytes += k * self.host_pool.bytes_per_page
        else:
            self.host_pool.free(host)
        if slot is not None and self.states is not None:
            self.states.free(slot)
        self._finish(fetch, "completed" if taken else ("revoked" if k else "empty"))

    def _finish(self, fetch: Fetch, outcome: str) -> None:
        self.fetches.remove(fetch)
        self.counters.prefetch[outcome] += 1
        req = fetch.req
        if req is not None and req.storage_fetch is fetch:
            req.storage_fetch = None
        self.wake()

    # ---- hit accounting ---------------------------------------------------------------
    def split_hit(self, req: Request, start: int, num_tokens: int) -> int:
        """Of the host-hit tokens [start, start + num_tokens) of `req`, how many its own
        storage fetch brought in (they count as storage hits)."""
        if req.storage_span is None:
            return 0
        lo, hi = req.storage_span
        served = max(0, min(hi, start + num_tokens) - max(lo, start))
        self.counters.hit_tokens += served
        return served

    # ---- health -----------------------------------------------------------------------
    def _result(self, fut: asyncio.Future[Any], default: Any) -> tuple[Any, bool]:
        if fut.cancelled():
            return default, False
        exc = fut.exception()
        if exc is not None:
            self.counters.failures["error"] += 1
            log.warning("storage_call_failed", error=repr(exc))
            return default, False
        result, healthy = fut.result()
        return result, healthy

    def _outcome(self, ok: bool) -> None:
        """Count an operation; `fail_limit` failures in a row switch the backend off."""
        self.failing = 0 if ok else self.failing + 1
        if self.enabled and self.failing >= self.fail_limit:
            self.enabled = False
            self.counters.switched_off += 1
            log.error("storage_switched_off", failures_in_a_row=self.failing,
                      backend=type(self.backend).__name__, hint="admin socket: {\"type\": \"storage\", \"enable\": true}")

    def set_enabled(self, enabled: bool) -> None:
        """The admin switch: on again after an outage (or off by hand)."""
        self.enabled, self.failing = enabled, 0
        log.info("storage_switched", enabled=enabled)

    # ---- accounting and shutdown ---------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.fetches or self.writes)

    def held_host_pages(self) -> list[int]:
        return [p for fetch in self.fetches for p in fetch.host_pages]

    def held_states(self) -> list[int]:
        """State slots hybrid fetches in flight fill (theirs until the tree takes them)."""
        return [fetch.state_slot for fetch in self.fetches if fetch.state_slot is not None]

    def stats(self) -> dict[str, Any]:
        """The tier's counters and the backend's stats (a slow backend's: the last ones,
        at most STATS_MAX_AGE_S old plus one refresh, never fetched on the calling
        thread). Changes nothing else."""
        self._refresh_backend_stats()
        c = self.counters
        return {
            "backend": type(self.backend).__name__, "enabled": self.enabled, "backend_stats": self.backend_stats,
            "hit_tokens": c.hit_tokens, "written_pages": c.written_pages, "written_bytes": c.written_bytes,
            "backfilled_pages": c.backfilled_pages, "backlog_nodes": len(self.backlog),
            "read_pages": c.read_pages, "read_bytes": c.read_bytes, "queued_bytes": self.queued_bytes,
            "switched_off": c.switched_off, "prefetch": dict(c.prefetch), "failures": dict(c.failures),
            "max_bytes": getattr(self.backend, "max_bytes", None),
        }

    def _refresh_backend_stats(self) -> None:
        if self.backend.cheap_stats:
            self.backend_stats = self.backend.stats()
            return
        if self._stats_refreshing or time.monotonic() - self._stats_time < STATS_MAX_AGE_S:
            return
        self._stats_refreshing = True

        def refresh() -> None:
            try:
                self.backend_stats = self.backend.stats()  # one reference swap: atomic
            finally:
                self._stats_time, self._stats_refreshing = time.monotonic(), False

        try:
            self.reader.submit(refresh)
        except RuntimeError:  # shut down
            self._stats_refreshing = False

    def close(self, timeout_s: float | None = None) -> bool:
        """Finish the writes already queued (within `timeout_s`, default
        `storage_flush_timeout_s`), drop reads, release the backend. True if every queued
        write landed. Blocks: call it off the loop."""
        timeout = self.flush_timeout_s if timeout_s is None else timeout_s
        flushed = self.writer.shutdown(wait=True, timeout=timeout)
        self.reader.shutdown(wait=False, cancel_futures=True)
        if not flushed:
            log.warning("storage_flush_incomplete", timeout_s=timeout)
        self.backend.close()
        return flushed
