"""The prefix cache's contract: tokens, pages and opaque match handles, never requests.

Implementations: `RadixTree` (cache/radix_tree.py, `cache.prefix: radix`) and
`NoPrefixCache` below (`cache.prefix: none`). The request-aware side — which request
fields a match sets, when a request inserts, what it frees — is the scheduler's
(kernel/scheduling/prefix_reuse.py).

NOTE: page ownership (invariant 3). Every allocated page has exactly one owner: the
cache (the page was inserted and not evicted) or the caller that allocated it. `match`
lends pages, `insert` takes the caller's pages except the duplicates it reports, and
only `evict` / `reset` give cached pages back to the allocator.

NOTE: state ownership (hybrid caches, invariant 2). The same rule for state slots (ids
into the state pool; slot 0 is reserved and never cached): `match` lends
`result.state_slot`, `insert(..., state_slot=s)` takes `s` unless it reports
`result.duplicate_state` (still the caller's), and only `evict` (with a leaf),
`evict_states` and `reset` give cached slots back. A slot covers exactly the prefix
length it was inserted with. A dense cache (`hybrid` False) holds no slots and rejects
`state_slot`.

NOTE: host ownership (tiered caches, cache/radix_host.py). The same rule for host pages
(ids into the host pool, 0 reserved): `mark_host` takes the caller's host copy of an
entry's device pages, `match` lends `result.host_pages` (the part of the prefix cached on
host only, right after the device part), `restore` takes the device pages the caller
loaded them into, and only `evict_host`, `evict` and `reset` give host pages back. A
cache without a host tier (`tiered` False) matches no host part and refuses `mark_host`
and `restore`.

A match result is deliberately a small record (`length`, `node`, `pages`) whose `node`
is an opaque handle the caller only passes back to `lock` / `unlock`; tiered or
hybrid caches extend the record (lengths per tier, a resumable state) without the
caller learning how the cache stores anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from cache.kv_events import KVEvent, Subscriber
from cache.radix_node import InsertResult, MatchResult, TreeNode

__all__ = ["InsertResult", "MatchResult", "NoPrefixCache", "PrefixCache"]


class PrefixCache(ABC):
    """What the scheduler may ask of a prefix cache. Matches and inserts are whole pages."""

    reuses = True  # whether a match can ever be non-empty
    page_size: int

    @property
    def hybrid(self) -> bool:
        """Whether entries carry state slots (attention + linear-attention/SSM models)."""
        return False

    @property
    def tiered(self) -> bool:
        """Whether entries may keep host copies (`mark_host`, `evict_host`, `restore`)."""
        return False

    @property
    def total_host_pages(self) -> int:
        """Host pages the cache owns now (0 unless `tiered`)."""
        return 0

    @property
    @abstractmethod
    def total_pages(self) -> int:
        """Pages the cache owns now."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Owned pages in unlocked entries: what repeated `evict` calls could free."""

    @property
    def total_states(self) -> int:
        """State slots the cache owns now (0 unless `hybrid`)."""
        return 0

    @property
    def evictable_states(self) -> int:
        """Owned state slots of unlocked entries: what repeated `evict_states` could free."""
        return 0

    @abstractmethod
    def match(
        self, tokens: Sequence[int], namespace: str | None = None, *, priority: int = 0, touch: bool = True
    ) -> MatchResult:
        """Longest cached whole-page prefix of `tokens` in `namespace`.

        May change: access statistics of the matched entries (only with `touch`), and
        the cache's internal layout (a node may split) — never which tokens are cached.
        The pages are lent: lock the handle before anything can call `evict`.

        Hybrid: the match stops at the deepest cached prefix that has a state slot for
        exactly its length (`result.state_slot`, lent like the pages and protected by
        the same lock; None for length 0: start from a fresh state) and
        `result.lost_tokens` counts the cached KV past it. Tiered: `length`/`pages` are
        the device part, `host_length`/`host_pages`/`host_node` the contiguous host part
        after it. `result.kv_length` = length + host_length + lost_tokens; a dense tree
        without a host tier has `state_slot` None and `kv_length == length`.
        """

    @abstractmethod
    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        namespace: str | None = None,
        priority: int = 0,
        state_slot: int | None = None,
    ) -> InsertResult:
        """Cache `tokens` (whole pages) backed by `pages`, one page per page of tokens.

        May change: which tokens are cached (more), page ownership (the cache takes every
        page of `pages` except `result.duplicates(pages)`, which the caller still owns and
        must free after pointing its table at `result.pages`). The handle is unlocked.
        Hybrid only: `state_slot` holds the state after exactly `len(tokens)` tokens; the
        cache takes it unless `result.duplicate_state` returns it (the caller frees it).
        A dense cache raises ValueError for a `state_slot`.
        """

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Protect the handle's pages and state slots (and its whole prefix's) from eviction."""

    @abstractmethod
    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock`; raises ValueError if the handle is not locked."""

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Free at least `num_pages` unlocked pages if possible (through the allocator's
        free callback); returns the freed ids. Locked entries are never touched. An
        evicted entry's state slot (hybrid) is freed with it."""

    def next_victims(self, num_pages: int) -> list[TreeNode]:
        """The unlocked entries an `evict(num_pages)` would take now, in order; changes
        nothing. Caches that cannot say return []."""
        return []

    def evict_states(self, num_slots: int) -> list[int]:
        """Hybrid: free up to `num_slots` state slots of unlocked entries (through the
        state pool's free callback), keeping their pages cached; returns the freed slots.
        Locked entries are never touched. Caches without states return []."""
        return []

    def evict_host(self, num_pages: int) -> list[int]:
        """Tiered: free at least `num_pages` host pages of unlocked entries if possible
        (through the host pool's free callback), entries that are also on the device
        keeping their device pages; returns the freed host ids. Locked entries are never
        touched. Caches without a host tier return []."""
        return []

    def mark_host(self, node: TreeNode, host_pages: Sequence[int]) -> None:
        """Tiered: the caller copied the device pages of the (locked) handle `node` to
        `host_pages` and verified them; the cache takes them. Caches without a host tier
        raise ValueError (the caller still owns `host_pages`)."""
        raise ValueError(f"{type(self).__name__} has no host tier")

    def insert_host(
        self, tokens: Sequence[int], host_pages: Sequence[int], namespace: str | None = None,
        state_slot: int | None = None,
    ) -> tuple[TreeNode | None, list[int]]:
        """Tiered: cache `tokens` (whole pages) whose last `len(host_pages)` pages the
        caller filled host pages with (from storage); the cache takes those it has no
        pages for yet and returns (the new host-only entry or None, the caller's host
        pages it did not take, for the caller to free). Hybrid caches take `state_slot`
        (the state after all of `tokens`) with a new entry, else the caller keeps it.
        Caches without a host tier raise ValueError (the caller still owns everything)."""
        raise ValueError(f"{type(self).__name__} has no host tier")

    def restore(self, host_node: TreeNode, device_pages: Sequence[int]) -> None:
        """Tiered: the caller loaded the host part of a match ending at `host_node`
        (`result.host_node`, locked) into `device_pages`; the cache takes them. Caches
        without a host tier raise ValueError (the caller still owns `device_pages`)."""
        raise ValueError(f"{type(self).__name__} has no host tier")

    @abstractmethod
    def reset(self) -> None:
        """Drop everything cached (pages, state slots, host copies); raises while anything
        is locked."""

    @abstractmethod
    def check_integrity(
        self,
        held_pages: Iterable[int] = (),
        held_states: Iterable[int] = (),
        held_host_pages: Iterable[int] = (),
    ) -> None:
        """Raise AssertionError if the cache's bookkeeping is broken, or if one of
        `held_pages` / `held_states` / `held_host_pages` (pages, state slots and host
        pages callers own) is also owned by the cache."""

    def set_policy(self, policy: Any) -> None:
        """Switch the eviction policy (caches without eviction ignore it)."""

    def snapshot(self) -> list[dict[str, Any]]:
        """One dict per entry, for inspection (the admin socket)."""
        return []

    def continuation(self, tokens: Sequence[int], namespace: str | None, count: int) -> list[int]:
        """Up to `count` tokens cached right after `tokens` ([] where none is known);
        read-only (no split, no stats)."""
        return []

    def index_ngrams(self, lengths: Sequence[int]) -> None:
        """From now on, keep what follows each cached n-gram of these lengths (for
        `ngram_continuation`); a cache that keeps nothing ignores it."""

    def ngram_continuation(self, gram: Sequence[int], namespace: str | None, count: int) -> list[int]:
        """Up to `count` tokens that followed `gram` in the latest cached sequence holding it
        ([] where none is known); read-only."""
        return []

    def subscribe(self, callback: Subscriber) -> Callable[[], None] | None:
        """Follow KV events; None if this cache publishes none."""
        return None

    def snapshot_events(self) -> list[KVEvent]:
        """The cache as events a new follower applies to hold its view: AllBlocksCleared,
        then what is cached now (none if this cache publishes no events). Changes nothing."""
        return []


class NoPrefixCache(PrefixCache):
    """`cache.prefix: none`: nothing is ever cached; every caller keeps its pages."""

    reuses = False

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._root = TreeNode(0, (), [], [], None, None)

    @property
    def total_pages(self) -> int:
        return 0

    @property
    def evictable_pages(self) -> int:
        return 0

    def match(
        self, tokens: Sequence[int], namespace: str | None = None, *, priority: int = 0, touch: bool = True
    ) -> MatchResult:
        return MatchResult(0, self._root, [])

    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        namespace: str | None = None,
        priority: int = 0,
        state_slot: int | None = None,
    ) -> InsertResult:
        raise NotImplementedError("cache.prefix is none: nothing may be inserted")

    def lock(self, node: TreeNode) -> None:
        pass

    def unlock(self, node: TreeNode) -> None:
        pass

    def evict(self, num_pages: int) -> list[int]:
        return []

    def reset(self) -> None:
        pass

    def check_integrity(
        self,
        held_pages: Iterable[int] = (),
        held_states: Iterable[int] = (),
        held_host_pages: Iterable[int] = (),
    ) -> None:
        pass
