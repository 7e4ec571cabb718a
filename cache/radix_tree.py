"""Radix prefix cache over whole pages: match, insert, lock, evict. A pure data structure.

NOTE: invariant 3 (page accounting) depends on this ownership rule. Every allocated page
id has exactly one owner: the tree (the page sits in a node) or one request (it
allocated the page and has not inserted it yet).
- `match` lends the tree's pages; the tree still owns them. Lock the node while they
  are in use, or an `evict` may hand them back to the allocator.
- `insert` takes ownership of the caller's pages past `prefix_len`. For the first
  `prefix_len` tokens the tree already had pages: where the caller's page differs from
  the tree's (`InsertResult.duplicates(pages)`) the caller still owns it and must free
  it, after pointing its request table at `InsertResult.pages`. The tree never frees a
  page it was not given.
- Only `evict` and `reset` return tree pages, through the `free_pages` callback.

NOTE: invariant 4. `lock` counts along the whole path to the root, so a parent's count
is >= each child's and a locked node's ancestors are locked too. Only unlocked leaves
are evicted, and `reset` refuses while anything is locked.

Eviction pops unlocked leaves from a lazily invalidated heap keyed by the policy
(cache/evict_heap.py): O(k log n) for k evicted nodes, never a tree scan.

Hybrid trees (`free_states` given) also own state slots, at most one per node for its
exact end position; a match resumes only at a node holding one. Ownership, locks and
the second eviction order of slots: cache/radix_states.py.

Walking a key down the tree, splitting, adding and detaching nodes: cache/radix_shape.py.

Tiered trees (`free_host_pages` given) also own host copies (bookkeeping: cache/radix_host_copies.py): a node may keep its KV in
host memory and stay matchable without device pages. Residency, the top-subtree
invariant, ownership, locks and the third eviction order: cache/radix_host.py.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from cache import radix_lookup
from cache.evict_heap import EvictHeap
from cache.evict_policy import EvictPolicy
from cache.kv_events import (
    AllBlocksCleared,
    BlockStored,
    EventHub,
    KVEvent,
    Subscriber,
)
from cache.prefix_cache import PrefixCache
from cache.radix_check import TreeIntegrityError, check_tree
from cache.radix_host import FreeHostPages, HostTierMixin, TreeHost, removed_events
from cache.radix_ngrams import NgramIndex
from cache.radix_node import InsertResult, MatchResult, PageKey, TreeNode
from cache.radix_shape import TreeShape
from cache.radix_states import FreeStates, TreeStates

__all__ = ["InsertResult", "MatchResult", "RadixTree", "TreeIntegrityError", "TreeLockedError", "TreeNode"]

FreePages = Callable[[list[int]], None]

class TreeLockedError(RuntimeError):
    """`reset` while a node is locked, or a lock on a node that is no longer in the tree."""


class RadixTree(TreeShape, HostTierMixin, PrefixCache):
    """`cache.prefix: radix`; the PrefixCache contract, with the rules in the docstring above."""

    def __init__(
        self,
        page_size: int,
        free_pages: FreePages,
        policy: EvictPolicy,
        strict_events: bool = False,
        free_states: FreeStates | None = None,
        free_host_pages: FreeHostPages | None = None,
    ) -> None:
        """`free_states` makes a hybrid tree: it receives the state slots the tree gives
        back (evict, evict_states, reset), as `free_pages` receives pages.
        `free_host_pages` makes a tiered tree: it receives the host pages the tree gives
        back (evict_host, evict, reset)."""
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self._free_pages = free_pages
        self._ids = itertools.count()
        self.root = TreeNode(next(self._ids), (), [], [], None, None)
        self._clock = 0
        self._wall = 0.0
        self._heap = EvictHeap(policy)
        self._events = EventHub(strict_events)  # strict: a failing subscriber raises (debug)
        self._total = 0
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._states = TreeStates(free_states, policy, self._events) if free_states is not None else None
        self._host = TreeHost(free_host_pages, policy, self._events) if free_host_pages is not None else None
        self._ngrams: NgramIndex | None = None  # `index_ngrams` (speculative decoding's n-gram drafter)

    # -- counters ------------------------------------------------------------------
    @property
    def policy(self) -> EvictPolicy:
        return self._heap.policy

    @property
    def total_pages(self) -> int:
        return self._total

    @property
    def evictable_pages(self) -> int:
        """Pages in unlocked nodes: what repeated `evict` calls could free."""
        return self._evictable

    @property
    def protected_pages(self) -> int:
        """Pages in locked nodes."""
        return self._protected

    @property
    def hybrid(self) -> bool:
        """Whether the tree holds state slots (a hybrid model's cache)."""
        return self._states is not None

    @property
    def total_states(self) -> int:
        """State slots the tree owns (0 on a dense tree)."""
        return self._states.total if self._states is not None else 0

    @property
    def evictable_states(self) -> int:
        """Owned state slots on unlocked nodes: what repeated `evict_states` could free."""
        return self._states.evictable if self._states is not None else 0

    @property
    def num_nodes(self) -> int:
        """Nodes other than the root."""
        return self._num_nodes

    # -- match / insert ------------------------------------------------------------
    def match(
        self, tokens: Sequence[int], namespace: str | None = None, *, priority: int = 0, touch: bool = True
    ) -> MatchResult:
        """Longest cached prefix of `tokens` in whole pages (hybrid: that is resumable).

        The caller keeps at least one token uncached if it needs logits (pass tokens[:-1]).
        `touch=False` probes without counting a hit (e.g. for scheduling order); a match
        that ends inside a node splits it either way, so `node` ends exactly where the
        KV match ends. On a hybrid tree the result is trimmed back to the deepest matched
        node holding a state slot (the root if none: a fresh state), `state_slot` is
        lent like the pages, and only the nodes up to it are touched.

        Tiered trees: `length`/`node`/`pages` are the device part; the host-only nodes
        after it are the host part (`host_length`, `host_pages` lent like pages,
        `host_node`; the top-subtree invariant makes it one contiguous run). Hybrid and
        tiered: the host part is offered only when the device part was not trimmed, and
        ends at the deepest host-only node holding a state slot (`host_node.state_slot`,
        the state after `length + host_length` tokens); else it is empty.
        """
        toks = self._whole_pages(tokens)
        if touch:
            self._tick()
        path = self._walk(toks, namespace)
        kv_length = sum(len(node.key) for node in path)
        device, host_path = self._usable_parts(path)
        if touch:
            for node in (*device, *host_path):
                self._touch(node, priority, hit=True)
        pages = [page for node in device for page in node.pages]
        host_pages = [page for node in host_path for page in node.host_pages or ()]
        length, host_length = len(pages) * self.page_size, len(host_pages) * self.page_size
        end = device[-1] if device else self.root
        host_node = host_path[-1] if host_path else None
        lost = kv_length - length - host_length
        return MatchResult(length, end, pages, end.state_slot, lost, host_length, host_pages, host_node)

    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        namespace: str | None = None,
        priority: int = 0,
        state_slot: int | None = None,
    ) -> InsertResult:
        """Cache `tokens` (whole pages) backed by `pages`; see the ownership rule above.

        `state_slot` (hybrid trees only): a slot holding the state after exactly
        `len(tokens)` tokens; the tree takes it and attaches it to the returned node
        unless that node already has one: then `duplicate_state` is the caller's slot,
        still the caller's to free (None if it is the node's own slot). A slot the tree
        took must not be written by the caller again.

        The returned node is unlocked: a request still using the pages (or, having
        given its slot away, resuming from it) locks it before anything can call `evict`.

        Tiered trees: `prefix_len` counts device-cached tokens only. Host-only nodes along
        `tokens` take the caller's pages for their tokens (the caller computed that KV
        itself) and become device+host, so every page past `prefix_len` is the tree's.
        """
        toks = tuple(tokens)
        self._check_insert(toks, pages, state_slot)
        self._tick()
        path = self._walk(toks, namespace)
        for node in path:
            self._touch(node, priority, hit=False)
        found = [page for node in path for page in node.pages]
        prefix_len = len(found) * self.page_size
        found += self._adopt_host_suffix(path, pages, len(found))
        end = path[-1] if path else self.root
        if len(found) * self.page_size < len(toks):
            rest = list(pages[len(found) :])
            start = len(found) * self.page_size
            end = self._add_leaf(end, toks[start:], rest, namespace, priority)
            found += end.pages
            if self._ngrams is not None:
                self._ngrams.add(namespace, toks, start, end)
        duplicate = None
        if self._states is not None and state_slot is not None:
            duplicate = self._states.take(end, state_slot, len(toks))
        return InsertResult(prefix_len, end, found, duplicate)

    # -- locks ---------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction, their pages, (hybrid) state
        slots and (tiered) host copies alike: one lock count serves all. Locking the root
        is a no-op."""
        self._require_attached(node)
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
                self._protected += len(node.pages)
                if self._states is not None:
                    self._states.on_lock(node)
                if self._host is not None:
                    self._host.on_lock(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`; raises ValueError if `node` is not locked."""
        self._require_attached(node)
        if node.parent is not None and node.lock_ref <= 0:
            raise ValueError(f"unlock of an unlocked node {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.pages)
                self._evictable += len(node.pages)
                if node.is_evictable_leaf:
                    self._heap.push(node)
                if self._states is not None:
                    self._states.on_unlock(node)
                if self._host is not None:
                    self._host.on_unlock(node)
            node = node.parent

    # -- eviction ------------------------------------------------------------------
    def evict(self, num_pages: int) -> list[int]:
        """Free at least `num_pages` device pages if unlocked leaves allow; returns them.

        Whole nodes' pages go, so a call may free more than asked. A hybrid leaf's state
        slot goes with it (through `free_states`). May change: pages and slots owned.
        Tiered trees: a candidate is an unlocked node with device pages and no
        device-resident child. With a host copy it only loses its device pages (it stays,
        host-only and matchable: BlockRemoved medium "device"); without one it leaves the
        tree with its host-only descendants, whose host pages go to `free_host_pages`.
        """
        freed: list[int] = []
        gone: list[TreeNode] = []
        demoted: list[TreeNode] = []
        host_freed: list[int] = []
        while len(freed) < num_pages:
            node = self._heap.pop()
            if node is None:
                break
            freed.extend(node.pages)
            parent = self._evict_node(node, gone, demoted, host_freed)
            if parent.is_evictable_leaf:
                self._heap.push(parent)
        if freed:
            self._free_pages(freed)
            if self._host is not None:
                self._host.free(host_freed)
            events = self._states.release(gone) if self._states is not None else []
            self._events.emit(
                # A demoted node may leave later in the same call (with a device-only
                # parent): its "device" removal comes first.
                lambda: [*removed_events(demoted, "device"), *events, *removed_events(gone, None)]
            )
        return freed

    def next_victims(self, num_pages: int) -> list[TreeNode]:
        """The nodes `evict(num_pages)` would take now, in order (unlocked device-eviction
        candidates); changes nothing. For write-back: copy them before they go."""
        return self._heap.peek(num_pages)

    def evict_states(self, num_slots: int) -> list[int]:
        """Free the state slots of up to `num_slots` unlocked nodes (leaves or internal),
        smallest policy key first, through `free_states`; returns the freed slots.

        May change: slots owned; the nodes and their KV stay, each now a tombstone (a
        tombstone leaf is still evicted by `evict` like any leaf). [] on a dense tree.
        """
        return self._states.evict(num_slots) if self._states is not None else []

    def reset(self) -> None:
        """Free every page, state slot and host copy; refuses while any node is locked."""
        locked_host = self._host.total - self._host.evictable if self._host is not None else 0
        if self._protected or locked_host:
            raise TreeLockedError(
                f"reset with {self._protected} locked pages, {locked_host} locked host pages"
            )
        nodes = list(self.nodes())
        pages = [page for node in nodes for page in node.pages]
        slots = self._states.clear(nodes) if self._states is not None else []
        host_pages = self._host.clear(nodes) if self._host is not None else []
        for node in nodes:
            node.parent = None  # detached: a stale reference can no longer be locked
        if self._ngrams is not None:
            self._ngrams.clear()
        self.root.children = {}
        self._heap.clear()
        self._total = self._evictable = self._num_nodes = 0
        if pages:
            self._free_pages(pages)
        if self._states is not None:
            self._states.free(slots)
        if self._host is not None:
            self._host.free(host_pages)
        self._events.emit(lambda: [AllBlocksCleared()])

    def set_policy(self, policy: EvictPolicy) -> None:
        """Switch eviction policy; rebuilds the heaps in O(nodes) (an admin action)."""
        self._heap.rebuild(policy, self.nodes())
        if self._states is not None:
            self._states.set_policy(policy, self.nodes())
        if self._host is not None:
            self._host.set_policy(policy, self.nodes())

    # -- events and inspection -----------------------------------------------------
    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(events)` after each operation that changed cached pages.

        Callbacks run synchronously inside tree operations: keep them cheap (push into a
        bounded queue). Returns a function that unsubscribes.
        """
        return self._events.subscribe(callback)

    def snapshot_events(self) -> list[KVEvent]:
        """The tree as events (PrefixCache.snapshot_events): AllBlocksCleared, then per node,
        parents first, BlockStored for its device pages and BlockStored(medium="host") for
        its host copy — what a follower that saw every event since the tree was empty holds
        now. NOTE: the hashes are the nodes' own, so a follower's later events chain on."""
        events: list[KVEvent] = [AllBlocksCleared()]
        for node in self.nodes():
            assert node.parent is not None
            stored = (list(node.hashes), node.parent.hash, list(node.key), self.page_size)
            if node.pages:
                events.append(BlockStored(*stored))
            if node.host_pages is not None:
                events.append(BlockStored(*stored, medium="host"))
        return events

    def nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children. Do not mutate while iterating."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def continuation(self, tokens: Sequence[int], namespace: str | None, count: int) -> list[int]:
        return radix_lookup.continuation(self.root, self.page_size, tokens, namespace, count)

    def index_ngrams(self, lengths: Sequence[int]) -> None:
        """From now on, index what follows each n-gram of these lengths (cache/radix_ngrams.py)."""
        self._ngrams = NgramIndex(lengths)

    def ngram_continuation(self, gram: Sequence[int], namespace: str | None, count: int) -> list[int]:
        return self._ngrams.lookup(namespace, gram, count) if self._ngrams is not None else []

    def snapshot(self) -> list[dict[str, Any]]:
        """One dict per node, root first, for the admin inspector."""
        return [node.describe() for node in itertools.chain([self.root], self.nodes())]

    def check_integrity(
        self,
        held_pages: Iterable[int] = (),
        held_states: Iterable[int] = (),
        held_host_pages: Iterable[int] = (),
    ) -> None:
        """Raise TreeIntegrityError unless the tree is consistent; `held_pages`,
        `held_states` and `held_host_pages` are the pages, state slots and host pages
        callers own (they must not be in the tree). O(tree): debug only."""
        live = self._heap.live_ids()
        counters = (self._total, self._evictable, self._protected, self._num_nodes)
        states = self._states.book() if self._states is not None else None
        host = self._host.book() if self._host is not None else None
        check_tree(
            self.root, self.page_size, counters, live, held_pages, states, held_states, host, held_host_pages
        )

    # -- internals -----------------------------------------------------------------
    def _whole_pages(self, tokens: Sequence[int]) -> PageKey:
        return tuple(tokens[: len(tokens) // self.page_size * self.page_size])

    def _check_insert(self, toks: PageKey, pages: Sequence[int], state_slot: int | None) -> None:
        ps = self.page_size
        if len(toks) % ps or len(pages) != len(toks) // ps:
            raise ValueError(f"{len(toks)} tokens and {len(pages)} pages do not make whole pages of {ps}")
        if 0 in pages:
            raise ValueError("page 0 is reserved and never cached")
        if state_slot is not None:
            if self._states is None:
                raise ValueError("a dense tree (no free_states) holds no state slots")
            self._states.check_slot(state_slot, len(toks))

    def _tick(self) -> None:
        self._clock += 1
        self._wall = time.monotonic()

    def _touch(self, node: TreeNode, priority: int, hit: bool) -> None:
        node.last_access = self._clock
        node.last_access_wall = self._wall
        node.hit_count += hit
        node.priority = max(node.priority, priority)
        if node.is_evictable_leaf:
            self._heap.push(node)  # re-key: the old entry goes stale
        if self._states is not None:
            self._states.on_touch(node)
        if self._host is not None:
            self._host.on_candidate(node)

    def _require_attached(self, node: TreeNode) -> None:
        if node.parent is None and node is not self.root:
            raise TreeLockedError(f"{node!r} is no longer in the tree (evicted or reset)")
