"""Stateful property test: random requests drive a radix tree and a real page allocator.

Simulated requests follow the engine's life cycle: match and lock a cached prefix,
allocate pages for the rest, insert after chunks (moving the lock to the new node,
freeing the duplicates they own), then finish or abort. After every step the tree must
pass its integrity check, every page must have exactly one owner (invariant 3), locked
prefixes must still be cached (invariant 4), and the KV events must describe the tree.

`HybridRadixMachine` runs the same life cycle on a hybrid tree with a real state-slot
free list: each request holds a working slot, offers a checkpoint slot (or, on finish,
its working slot) with some inserts, and slots are evicted on their own. After every
step every slot has exactly one owner (free list, tree or a request), every cached slot
covers exactly its node's key length (invariant 2), and locked slots are still cached.

`HostRadixMachine` adds a host tier with a real host-page free list and simulated KV
content (each device and host page records the hash of the tokens it holds): copies to
host land in flight (locked while copying, refused if a split changed the node), device
and host eviction, and requests that load a matched host part back (lock `host_node`,
allocate, restore), and storage fetches that hand host pages to `insert_host` (from
before, at or after where a match ended: duplicates, a new stored host-only leaf, or a
gap that takes nothing). After every step every device page and host page has exactly
one owner, every page holds its node's tokens, and matches are device-then-host prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import event as tally
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache.allocator import PageAllocator
from cache.evict_policy import EvictPolicy
from cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    StateRemoved,
    StateStored,
    page_hashes,
)
from cache.radix_node import MatchResult
from cache.radix_tree import RadixTree, TreeNode
from handlers.evict_fifo import FIFO
from handlers.evict_lfu import LFU
from handlers.evict_lru import LRU
from handlers.evict_priority import PriorityLRU
from tests.test_radix_states import SlotPool

NUM_PAGES = 32  # small, so eviction and refusals happen often
NUM_SLOTS = 8  # hybrid: 7 usable state slots, so state eviction and refusals happen too
MAX_REQUESTS = 6
POLICIES: dict[str, type[EvictPolicy]] = {"lru": LRU, "lfu": LFU, "fifo": FIFO, "priority": PriorityLRU}

# A tiny alphabet and few namespaces make shared prefixes, splits and duplicates common.
page_counts = st.integers(1, 6)
token_pools = st.lists(st.integers(0, 2), min_size=24, max_size=24)
namespaces = st.sampled_from([None, None, "a"])
priorities = st.integers(0, 2)
picks = st.integers(0, 1000)


@dataclass
class Req:
    tokens: list[int]
    namespace: str | None
    priority: int
    node: TreeNode  # locked while the request lives
    table: list[int]  # one page per page of tokens: tree pages, then the request's own
    cached_pages: int  # leading pages of `table` the tree owns
    slot: int | None = None  # hybrid: the request's working state slot (its own)
    kept: dict[int, tuple[TreeNode, int]] | None = None  # slots on the locked path at lock time

    @property
    def owned(self) -> list[int]:
        return self.table[self.cached_pages :]


class RadixMachine(RuleBasedStateMachine):
    HYBRID = False
    HOST = False  # a host tier (HostRadixMachine)

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.slots = SlotPool(NUM_SLOTS)
        self.ps = 1
        self._tree: RadixTree | None = None
        self.requests: list[Req] = []
        self.cached_hashes: set[int] = set()  # what the events say is in the tree (on device)
        self.host_hashes: set[int] = set()  # what the events say has a host copy
        self.state_hashes: set[int] = set()  # what the events say is resumable
        self.unchecked: list[KVEvent] = []  # delivered but not yet checked

    @property
    def tree(self) -> RadixTree:
        assert self._tree is not None
        return self._tree

    @initialize(ps=st.sampled_from([1, 2, 4]), policy=st.sampled_from(sorted(POLICIES)))
    def setup(self, ps: int, policy: str) -> None:
        self.ps = ps
        free_states = self.slots.free if self.HYBRID else None
        free_host = self.host_free if self.HOST else None
        self._tree = RadixTree(
            ps, self.alloc.free, POLICIES[policy](), free_states=free_states, free_host_pages=free_host
        )
        self._tree.subscribe(self.unchecked.extend)

    def follow_events(self) -> None:
        """Check the delivered events here, in the test body: an assertion inside a
        subscriber would be caught and logged by the event hub, never failing a test."""
        events = list(self.unchecked)
        self.unchecked.clear()
        for event in events:
            if isinstance(event, BlockStored) and event.medium == "host":
                assert self.HOST and self.host_hashes.isdisjoint(event.block_hashes)
                if self.cached_hashes.isdisjoint(event.block_hashes):  # insert_host: a new host-only leaf
                    parent = event.parent_block_hash
                    assert parent is None or parent in self.cached_hashes | self.host_hashes
                    assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                else:  # mark_host: a copy of device pages
                    assert self.cached_hashes.issuperset(event.block_hashes)
                self.host_hashes.update(event.block_hashes)
            elif isinstance(event, BlockStored):
                assert event.medium is None
                assert event.parent_block_hash is None or event.parent_block_hash in self.cached_hashes
                assert self.cached_hashes.isdisjoint(event.block_hashes)
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                self.cached_hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.medium is not None:
                assert self.HOST and self.cached_hashes.issuperset(event.block_hashes)
                assert self.host_hashes.issuperset(event.block_hashes)
                gone = self.cached_hashes if event.medium == "device" else self.host_hashes
                gone.difference_update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert (self.cached_hashes | self.host_hashes).issuperset(event.block_hashes)
                assert self.state_hashes.isdisjoint(event.block_hashes), "a state outlived its page"
                self.cached_hashes.difference_update(event.block_hashes)
                self.host_hashes.difference_update(event.block_hashes)
            elif isinstance(event, StateStored):
                assert self.HYBRID and event.block_hash in self.cached_hashes
                assert event.block_hash not in self.state_hashes and event.num_tokens % self.ps == 0
                self.state_hashes.add(event.block_hash)
            elif isinstance(event, StateRemoved):
                assert event.block_hash in self.state_hashes
                self.state_hashes.discard(event.block_hash)
            elif isinstance(event, AllBlocksCleared):
                self.cached_hashes.clear()
                self.host_hashes.clear()
                self.state_hashes.clear()

    def host_free(self, pages: list[int]) -> None:
        """The tree's `free_host_pages` (host mode)."""
        raise NotImplementedError("only HostRadixMachine has a host tier")

    def wrote(self, pages: list[int], tokens: list[int], namespace: str | None, first: int) -> list[int]:
        """A request computed the KV of pages `first`, `first + 1`, ... of `tokens` into
        `pages`; returns `pages`. Host mode records the content."""
        return pages

    def tokens(self, num_pages: int, pool: list[int]) -> list[int]:
        return (pool * 4)[: num_pages * self.ps]

    def make_room(self, need: int) -> bool:
        """Evict until `need` pages are free, like the scheduler; False if locks prevent it."""
        if self.alloc.num_free < need:
            self.tree.evict(need - self.alloc.num_free)
        return self.alloc.num_free >= need

    def take_slot(self) -> int | None:
        """A free state slot, evicting a cached one if none is free; None if locks prevent it."""
        if not self.slots.num_free:
            self.checked_evict_states(1)
        return self.slots.allocate()

    def checked_evict_states(self, num_slots: int) -> list[int]:
        """`evict_states`, checked against a full scan: the policy's first candidate goes
        first, nothing locked goes, KV stays, the counters move by what was freed."""
        could = self.tree.evictable_states
        candidates = [n for n in self.tree.nodes() if n.state_slot is not None and n.lock_ref == 0]
        assert len(candidates) == could
        first = min(candidates, key=lambda n: (self.tree.policy.key(n), n.id), default=None)
        first_slot = first.state_slot if first is not None else None
        pages = self.tree.total_pages
        freed = self.tree.evict_states(num_slots)
        assert len(freed) == min(num_slots, could) and self.tree.total_pages == pages
        assert self.tree.evictable_states == could - len(freed)
        if first_slot is not None and num_slots > 0:  # the state heap agrees with a full scan
            assert freed[0] == first_slot
        kept = {slot for r in self.requests for _, slot in (r.kept or {}).values()}
        assert kept.isdisjoint(freed), "evicted a locked state"
        return freed

    def lock(self, req: Req, node: TreeNode) -> None:
        """Lock `node` for `req` and remember the slots its path holds (they must stay)."""
        self.tree.lock(node)
        req.node, req.kept = node, {}
        while node.parent is not None:
            if node.state_slot is not None:
                req.kept[node.id] = (node, node.state_slot)
            node = node.parent

    def check_match(self, hit_length: int, kv_length: int, node: TreeNode, slot: int | None) -> None:
        assert hit_length % self.ps == 0 and kv_length >= hit_length
        if not self.HYBRID:
            assert slot is None and (kv_length == hit_length or self.HOST)
        elif hit_length == 0:
            assert slot is None and node is self.tree.root
        else:
            assert slot is not None and node.state_slot == slot and node.state_len == hit_length

    # -- requests ------------------------------------------------------------------
    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(num_pages=page_counts, pool=token_pools, namespace=namespaces, priority=priorities)
    def start(self, num_pages: int, pool: list[int], namespace: str | None, priority: int) -> None:
        tokens = self.tokens(num_pages, pool)
        hit = self.tree.match(tokens, namespace, priority=priority)
        self.check_match(hit.length, hit.kv_length, hit.node, hit.state_slot)
        self.tree.lock(hit.node)  # before make_room: evict must not take the hit
        cached = hit.length // self.ps
        slot = self.take_slot() if self.HYBRID else None  # its working state (copied from the hit)
        if not self.make_room(num_pages - cached) or (self.HYBRID and slot is None):
            self.tree.unlock(hit.node)  # refused: waits in the queue, holds nothing
            if slot is not None:
                self.slots.free([slot])
            return
        table = hit.pages + self.wrote(self.alloc.allocate(num_pages - cached), tokens, namespace, cached)
        req = Req(tokens, namespace, priority, hit.node, table, cached, slot)
        self.tree.unlock(hit.node)
        self.lock(req, hit.node)  # the same lock, now with the path's slots recorded
        self.requests.append(req)

    def insert_prefix(self, req: Req, num_pages: int, state: int | None = None) -> TreeNode:
        """Cache the request's first `num_pages` pages (and `state`, a slot the request
        owns holding the state after them); the tree now owns them."""
        result = self.tree.insert(
            req.tokens[: num_pages * self.ps], req.table[:num_pages], req.namespace, req.priority, state
        )
        duplicates = result.duplicates(req.table[:num_pages])
        assert set(duplicates) <= set(req.owned), "the tree returned pages the request does not own"
        req.table[:num_pages] = result.pages  # repoint before freeing the duplicates
        self.alloc.free(duplicates)
        req.cached_pages = num_pages
        if state is not None:
            assert result.node.state_slot is not None and result.node.state_len == num_pages * self.ps
            assert result.duplicate_state in (None, state)
            assert (result.duplicate_state is None) == (result.node.state_slot == state)
            if result.duplicate_state is not None:
                self.slots.free([result.duplicate_state])  # still ours: the node had a state
        return result.node

    def checkpoint(self, with_state: bool) -> int | None:
        """A fresh slot for a copy of the working state, if wanted and one can be had."""
        return self.take_slot() if self.HYBRID and with_state else None

    @precondition(lambda self: any(r.owned for r in self.requests))
    @rule(pick=picks, cut=picks, with_state=st.booleans())
    def insert_chunk(self, pick: int, cut: int, with_state: bool) -> None:
        candidates = [r for r in self.requests if r.owned]
        req = candidates[pick % len(candidates)]
        end = req.cached_pages + 1 + cut % len(req.owned)
        node = self.insert_prefix(req, end, self.checkpoint(with_state))
        old = req.node
        self.lock(req, node)  # lock the new node before releasing the old one
        self.tree.unlock(old)

    @precondition(lambda self: self.requests)
    @rule(pick=picks, with_state=st.booleans())
    def finish(self, pick: int, with_state: bool) -> None:
        """A finished request may hand its working slot itself to the tree."""
        req = self.requests.pop(pick % len(self.requests))
        give = req.slot if with_state else None
        self.insert_prefix(req, len(req.table), give)
        if req.slot is not None and give is None:
            self.slots.free([req.slot])
        self.tree.unlock(req.node)

    @precondition(lambda self: self.requests)
    @rule(pick=picks)
    def abort(self, pick: int) -> None:
        req = self.requests.pop(pick % len(self.requests))
        self.alloc.free(req.owned)
        if req.slot is not None:
            self.slots.free([req.slot])
        self.tree.unlock(req.node)

    @precondition(lambda self: self.requests)
    @rule(pick=picks)
    def locked_prefix_is_still_cached(self, pick: int) -> None:
        req = self.requests[pick % len(self.requests)]
        cached = req.tokens[: req.cached_pages * self.ps]
        hit = self.tree.match(cached, req.namespace, touch=False)
        assert hit.kv_length == len(cached) and hit.pages == req.table[: hit.length // self.ps]
        self.check_match(hit.length, hit.kv_length, hit.node, hit.state_slot)
        if not self.HYBRID:
            assert hit.length == len(cached)

    @precondition(lambda self: any(r.cached_pages > 1 for r in self.requests))
    @rule(pick=picks, cut=picks)
    def split_a_locked_node(self, pick: int, cut: int) -> None:
        """Another prompt shares part of a running request's cached prefix."""
        candidates = [r for r in self.requests if r.cached_pages > 1]
        req = candidates[pick % len(candidates)]
        pages = 1 + cut % (req.cached_pages - 1)
        hit = self.tree.match(req.tokens[: pages * self.ps], req.namespace)
        assert hit.kv_length == pages * self.ps and hit.pages == req.table[: hit.length // self.ps]

    # -- cache operations ------------------------------------------------------------
    @rule(
        num_pages=page_counts,
        pool=token_pools,
        namespace=namespaces,
        priority=priorities,
        with_state=st.booleans(),
    )
    def insert_fresh(
        self, num_pages: int, pool: list[int], namespace: str | None, priority: int, with_state: bool
    ) -> None:
        """A caller that computed everything itself: all fresh pages (and maybe a fresh
        state slot), duplicates freed after."""
        if not self.make_room(num_pages):
            return
        pages = self.wrote(self.alloc.allocate(num_pages), self.tokens(num_pages, pool), namespace, 0)
        slot = self.checkpoint(with_state)
        result = self.tree.insert(self.tokens(num_pages, pool), pages, namespace, priority, slot)
        assert result.prefix_len % self.ps == 0
        self.alloc.free(result.duplicates(pages))
        if result.duplicate_state is not None:
            assert result.duplicate_state == slot
            self.slots.free([slot])

    @rule(num_pages=page_counts, pool=token_pools, namespace=namespaces, touch=st.booleans())
    def probe(self, num_pages: int, pool: list[int], namespace: str | None, touch: bool) -> None:
        hit = self.tree.match(self.tokens(num_pages, pool), namespace, touch=touch)
        assert hit.length % self.ps == 0 and len(hit.pages) == hit.length // self.ps
        self.check_match(hit.length, hit.kv_length, hit.node, hit.state_slot)

    @rule(num_pages=st.integers(0, 12))
    def evict(self, num_pages: int) -> None:
        could = self.tree.evictable_pages
        leaves = [n for n in self.tree.nodes() if n.is_evictable_leaf]
        first = min(leaves, key=lambda n: (self.tree.policy.key(n), n.id), default=None)
        freed = self.tree.evict(num_pages)
        assert len(freed) >= min(num_pages, could)
        if first is not None and num_pages > 0:  # the heap agrees with a full scan
            assert freed[: len(first.pages)] == first.pages
        locked = {p for r in self.requests for p in r.table[: r.cached_pages]}
        assert locked.isdisjoint(freed), "evicted a locked page"

    @precondition(lambda self: not self.requests)
    @rule()
    def reset(self) -> None:
        self.tree.reset()
        assert self.tree.total_pages == 0 and self.alloc.num_free == self.alloc.num_usable
        assert self.tree.total_states == 0 and self.slots.num_free == self.slots.num_usable

    @rule(policy=st.sampled_from(sorted(POLICIES)))
    def set_policy(self, policy: str) -> None:
        self.tree.set_policy(POLICIES[policy]())

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def tree_is_consistent(self) -> None:
        if self._tree is None:
            return
        held = [p for r in self.requests for p in r.owned]
        held_states = [r.slot for r in self.requests if r.slot is not None]
        self.tree.check_integrity(held_pages=held, held_states=held_states)
        assert self.alloc.num_free + self.tree.total_pages + len(held) == self.alloc.num_usable
        for req in self.requests:
            assert req.node is self.tree.root or req.node.lock_ref > 0
            for node, slot in (req.kept or {}).values():  # invariant 4 for states
                assert node.parent is not None and node.state_slot == slot, "a locked state was evicted"

    @invariant()
    def every_state_slot_has_one_owner(self) -> None:
        """Free list, tree or one request (invariant 3 for states), and a cached slot
        covers exactly its node's key length from the root (invariant 2)."""
        if self._tree is None:
            return
        in_tree: list[int] = []
        stack = [(self.tree.root, 0)]
        while stack:
            parent, end = stack.pop()
            for node in parent.children.values():
                if node.state_slot is not None:
                    assert node.state_len == end + len(node.key)
                    in_tree.append(node.state_slot)
                stack.append((node, end + len(node.key)))
        held = [r.slot for r in self.requests if r.slot is not None]
        owners = self.slots.free_list + in_tree + held
        assert sorted(owners) == list(range(1, NUM_SLOTS)), f"slot owners {sorted(owners)}"
        assert len(in_tree) == self.tree.total_states

    @invariant()
    def events_describe_the_tree(self) -> None:
        if self._tree is None:
            return
        self.follow_events()
        assert self.cached_hashes == {h for node in self.tree.nodes() if node.pages for h in node.hashes}
        assert self.host_hashes == {
            h for n in self.tree.nodes() if n.host_pages is not None for h in n.hashes
        }
        assert self.state_hashes == {n.hashes[-1] for n in self.tree.nodes() if n.state_slot is not None}


class HybridRadixMachine(RadixMachine):
    """The same requests on a hybrid tree, plus state eviction."""

    HYBRID = True

    @precondition(lambda self: self.tree.evictable_states > 0)
    @rule(num_slots=st.integers(0, NUM_SLOTS))
    def evict_states(self, num_slots: int) -> None:
        self.checked_evict_states(num_slots)

    @precondition(lambda self: self.tree.evictable_states > 1)
    @rule(pick=picks)
    def hit_then_evict_a_state(self, pick: int) -> None:
        """A hit re-keys the slots it resumes through: the next eviction must see it."""
        stateful = sorted(
            (n for n in self.tree.nodes() if n.state_slot is not None and n.lock_ref == 0), key=lambda n: n.id
        )
        node = stateful[pick % len(stateful)]
        tokens: list[int] = []
        end: TreeNode | None = node
        while end is not None and end.parent is not None:
            tokens[:0] = end.key
            end = end.parent
        hit = self.tree.match(tokens, node.namespace)
        assert hit.node is node and hit.state_slot == node.state_slot
        self.checked_evict_states(1)


NUM_HOST_PAGES = 24  # small, so host eviction happens often


@dataclass
class Copy:
    """A copy to host in flight: the node is locked, the host pages are the copier's."""

    node: TreeNode
    host: list[int]


class HostRadixMachine(RadixMachine):
    """The same requests on a tiered tree, plus write-through copies, host eviction and
    load-backs of matched host parts."""

    HOST = True

    def __init__(self) -> None:
        super().__init__()
        self.host_pool: list[int] = list(range(NUM_HOST_PAGES - 1, 0, -1))  # host page free list
        self.copies: list[Copy] = []
        self.kv: dict[int, int] = {}  # device page -> hash of the tokens it holds
        self.host_kv: dict[int, int] = {}  # host page -> hash of the tokens it holds

    def host_free(self, pages: list[int]) -> None:
        for page in pages:
            assert page != 0 and page not in self.host_pool, f"host page {page} freed twice"
            self.host_pool.append(page)

    def wrote(self, pages: list[int], tokens: list[int], namespace: str | None, first: int) -> list[int]:
        hashes = page_hashes(tokens, self.ps, namespace)
        for i, page in enumerate(pages):
            self.kv[page] = hashes[first + i]
        return pages

    def served(self, hit: MatchResult, tokens: list[int], namespace: str | None) -> None:
        """A match is a device part then a host part, each page holding its tokens."""
        hashes = page_hashes(tokens, self.ps, namespace)
        n, m = len(hit.pages), len(hit.host_pages)
        assert hit.length == n * self.ps and hit.host_length == m * self.ps
        assert [self.kv[p] for p in hit.pages] == hashes[:n], "a device page holds other tokens"
        assert [self.host_kv[h] for h in hit.host_pages] == hashes[n : n + m], (
            "a host page holds other tokens"
        )
        assert (hit.host_node is None) == (m == 0)
        if hit.host_node is not None:
            assert not hit.host_node.pages and hit.host_node.hash == hashes[n + m - 1]
        if n:
            assert hit.node.hash == hashes[n - 1] and hit.node.pages

    # -- requests ------------------------------------------------------------------
    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(num_pages=page_counts, pool=token_pools, namespace=namespaces, priority=priorities)
    def start(self, num_pages: int, pool: list[int], namespace: str | None, priority: int) -> None:
        """Admission that loads a matched host part back: lock `host_node` (it protects
        the whole path), make room, copy host -> device, `restore`."""
        tokens = self.tokens(num_pages, pool)
        hit = self.tree.match(tokens, namespace, priority=priority)
        self.served(hit, tokens, namespace)
        node = hit.host_node or hit.node
        length = hit.length + hit.host_length
        self.check_match(length, hit.kv_length, node, node.state_slot if length else None)
        self.tree.lock(node)
        slot = self.take_slot() if self.HYBRID else None
        if not self.make_room(num_pages - hit.length // self.ps) or (self.HYBRID and slot is None):
            self.tree.unlock(node)
            if slot is not None:
                self.slots.free([slot])
            return
        loaded = self.alloc.allocate(len(hit.host_pages))
        for page, host in zip(loaded, hit.host_pages):
            self.kv[page] = self.host_kv[host]
        if hit.host_node is not None:
            self.tree.restore(hit.host_node, loaded)
            assert hit.host_node.tier == "device+host"
        cached = length // self.ps
        table = (
            hit.pages
            + loaded
            + self.wrote(self.alloc.allocate(num_pages - cached), tokens, namespace, cached)
        )
        req = Req(tokens, namespace, priority, node, table, cached, slot)
        self.tree.unlock(node)
        self.lock(req, node)
        self.requests.append(req)

    # -- host tier -----------------------------------------------------------------
    @rule(pick=picks)
    def start_copy(self, pick: int) -> None:
        """The engine starts copying a device node without a host copy: lock it, take
        host pages (evicting host copies if needed)."""
        busy = {id(c.node) for c in self.copies}
        candidates = sorted(
            (n for n in self.tree.nodes() if n.pages and n.host_pages is None and id(n) not in busy),
            key=lambda n: n.id,
        )
        if not candidates:
            return
        node = candidates[pick % len(candidates)]
        self.tree.lock(node)
        need = len(node.pages)
        if len(self.host_pool) < need:
            self.checked_evict_host(need - len(self.host_pool))
        if len(self.host_pool) < need:
            self.tree.unlock(node)  # locks hold every host copy: no copy now
            return
        host = [self.host_pool.pop() for _ in range(need)]
        for page, h in zip(node.pages, host):
            self.host_kv[h] = self.kv[page]
        self.copies.append(Copy(node, host))

    @rule(pick=picks, num_pages=st.integers(0, 6))
    def copy_now_then_evict(self, pick: int, num_pages: int) -> None:
        """A write-through copy that lands at once, then device eviction, which now keeps
        the copied prefix matchable from host."""
        self.start_copy(pick)
        if self.copies:
            self.land_copy(len(self.copies) - 1, verified=True)
        self.evict(num_pages)

    @rule(pick=picks)
    def load_back(self, pick: int) -> None:
        """Match the prefix of a random host-only node and load its host part back, as an
        admission would, then drop the request before it computes anything."""
        host_only = sorted((n for n in self.tree.nodes() if not n.pages), key=lambda n: n.id)
        if not host_only:
            return
        tokens: list[int] = []
        walk: TreeNode | None = host_only[pick % len(host_only)]
        namespace = walk.namespace if walk is not None else None
        while walk is not None and walk.parent is not None:
            tokens[:0] = walk.key
            walk = walk.parent
        hit = self.tree.match(tokens, namespace)
        self.served(hit, tokens, namespace)
        if hit.host_node is None:
            assert self.HYBRID, "a dense tiered tree always offers the host part"
            return
        self.tree.lock(hit.host_node)
        if self.make_room(len(hit.host_pages)):
            loaded = self.alloc.allocate(len(hit.host_pages))
            for page, host in zip(loaded, hit.host_pages):
                self.kv[page] = self.host_kv[host]
            self.tree.restore(hit.host_node, loaded)
            again = self.tree.match(tokens[: hit.length + hit.host_length], namespace, touch=False)
            assert again.pages == hit.pages + loaded and again.host_length == 0
        self.tree.unlock(hit.host_node)

    @precondition(lambda self: self.copies)
    @rule(pick=picks, verified=st.booleans())
    def land_copy(self, pick: int, verified: bool) -> None:
        """The copy lands: `mark_host`, unless it failed to verify (freed, never served)
        or a split changed the node's page count meanwhile (refused, freed)."""
        copy = self.copies.pop(pick % len(self.copies))
        node = copy.node
        assert node.parent is not None and node.pages and node.host_pages is None, "a copied node changed"
        if not verified:
            self.host_free(copy.host)
        elif len(node.pages) != len(copy.host):
            with pytest.raises(ValueError, match="host pages"):
                self.tree.mark_host(node, copy.host)
            self.host_free(copy.host)
        else:
            stored = self.tree.total_host_pages
            self.tree.mark_host(node, copy.host)
            assert node.host_pages == copy.host and self.tree.total_host_pages == stored + len(copy.host)
        self.tree.unlock(node)

    def checked_evict_host(self, num_pages: int) -> list[int]:
        """`evict_host`, checked against a full scan: the policy's first candidate goes
        first, nothing locked goes, the counters move by what was freed."""
        could = self.tree.evictable_host_pages
        candidates = [n for n in self.tree.nodes() if n.is_host_candidate]
        first = min(candidates, key=lambda n: (self.tree.policy.key(n), n.id), default=None)
        first_host = list(first.host_pages or []) if first is not None else []
        total = self.tree.total_host_pages
        freed = self.tree.evict_host(num_pages)
        assert len(freed) >= min(num_pages, could) and self.tree.total_host_pages == total - len(freed)
        if first is not None and num_pages > 0:
            assert freed[: len(first_host)] == first_host
        locked = {h for n in self.tree.nodes() if n.lock_ref for h in n.host_pages or ()}
        assert locked.isdisjoint(freed), "evicted a locked host copy"
        return freed

    @rule(num_pages=st.integers(0, 12))
    def evict_host(self, num_pages: int) -> None:
        self.checked_evict_host(num_pages)

    @rule(
        num_pages=page_counts,
        pool=token_pools,
        namespace=namespaces,
        pick=picks,
        from_node=st.booleans(),
        shift=st.integers(-3, 2),
    )
    def fetch_from_storage(
        self, num_pages: int, pool: list[int], namespace: str | None, pick: int, from_node: bool, shift: int
    ) -> None:
        """A storage fetch: a match ends, the pages from `shift` pages past its end (before
        it: overlapping what the tree has; after it: a gap) land in fresh host pages (host
        copies evicted for them if needed, which may cut the match short), and
        `insert_host` takes those the tree lacks as one stored host-only leaf; the
        duplicates go back to the free list. Tokens extend a random node's path or are
        fresh (sharing prefixes by the tiny alphabet)."""
        nodes = sorted(self.tree.nodes(), key=lambda n: n.id)
        tokens = self.tokens(num_pages, pool)
        if from_node and nodes:
            walk: TreeNode | None = nodes[pick % len(nodes)]
            namespace = walk.namespace if walk is not None else None
            path: list[int] = []
            while walk is not None and walk.parent is not None:
                path[:0] = walk.key
                walk = walk.parent
            tokens = path + tokens[: (pick % 3) * self.ps]  # 0-2 pages past it (0: all present)
        total = len(tokens) // self.ps
        hit = self.tree.match(tokens, namespace)  # where the scheduler saw the prefix end
        self.served(hit, tokens, namespace)
        first = min(max(hit.kv_length // self.ps + shift, 0), total)
        need = total - first
        if len(self.host_pool) < need:
            self.checked_evict_host(need - len(self.host_pool))
        if len(self.host_pool) < need:
            return  # locked copies hold the host pool: no fetch now
        host = [self.host_pool.pop() for _ in range(need)]
        hashes = page_hashes(tokens, self.ps, namespace)
        for h, page_hash in zip(host, hashes[first:]):
            self.host_kv[h] = page_hash
        have = self.tree.match(tokens, namespace, touch=False).kv_length // self.ps
        nodes_before, host_before = self.tree.num_nodes, self.tree.total_host_pages
        leaf, dupes = self.tree.insert_host(tokens, host, namespace)
        tally(f"insert_host: {'gap' if have < first else 'all present' if have == total else 'taken'}")
        if leaf is not None and dupes:
            tally("insert_host: taken, with duplicates")
        if leaf is not None and leaf.parent is not None and leaf.parent.parent is not None:
            tally(f"insert_host: taken under a {leaf.parent.tier} node")
        if have < first or have == total:  # a gap, or nothing new
            assert leaf is None and dupes == host
            assert (self.tree.num_nodes, self.tree.total_host_pages) == (nodes_before, host_before)
        else:
            assert leaf is not None and dupes == host[: have - first]
            assert leaf.host_pages == host[have - first :] and leaf.pages == [] and leaf.stored
            assert leaf.key == tuple(tokens[have * self.ps :]) and leaf.hashes == hashes[have:]
            assert leaf.namespace == namespace and not leaf.children and leaf.lock_ref == 0
            assert self.tree.num_nodes == nodes_before + 1
            assert self.tree.total_host_pages == host_before + total - have
        in_flight = [h for c in self.copies for h in c.host]
        self.tree.check_integrity(
            held_pages=[p for r in self.requests for p in r.owned], held_host_pages=in_flight + dupes
        )
        self.host_free(dupes)
        after = self.tree.match(tokens, namespace, touch=False)
        self.served(after, tokens, namespace)
        if leaf is not None:
            assert after.kv_length == len(tokens) and after.host_node is leaf

    @rule(num_pages=page_counts, pool=token_pools, namespace=namespaces, touch=st.booleans())
    def probe(self, num_pages: int, pool: list[int], namespace: str | None, touch: bool) -> None:
        tokens = self.tokens(num_pages, pool)
        hit = self.tree.match(tokens, namespace, touch=touch)
        self.served(hit, tokens, namespace)
        self.check_match(hit.length, hit.kv_length, hit.node, hit.state_slot)

    @precondition(lambda self: not self.requests and not self.copies)
    @rule()
    def reset(self) -> None:
        super().reset()
        assert self.tree.total_host_pages == 0 and len(self.host_pool) == NUM_HOST_PAGES - 1

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def every_host_page_has_one_owner_and_every_page_its_tokens(self) -> None:
        if self._tree is None:
            return
        in_flight = [h for c in self.copies for h in c.host]
        self.tree.check_integrity(
            held_pages=[p for r in self.requests for p in r.owned], held_host_pages=in_flight
        )
        in_tree = [h for n in self.tree.nodes() for h in n.host_pages or ()]
        owners = sorted(self.host_pool + in_tree + in_flight)
        assert owners == list(range(1, NUM_HOST_PAGES)), f"host page owners {owners}"
        assert len(in_tree) == self.tree.total_host_pages
        for node in self.tree.nodes():
            assert [self.kv[p] for p in node.pages] in ([], node.hashes), (
                f"{node!r} device pages hold other KV"
            )
            if node.host_pages is not None:
                assert [self.host_kv[h] for h in node.host_pages] == node.hashes, (
                    f"{node!r} host copy is wrong"
                )
            if node.pages and node.parent is not self.tree.root:
                assert node.parent is not None and node.parent.pages, "a device node under a host-only one"
        for req in self.requests:  # a running request's KV is on the device, in its table
            assert [self.kv[p] for p in req.table] == page_hashes(req.tokens, self.ps, req.namespace)


RadixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestRadixTreeStateful = RadixMachine.TestCase
HybridRadixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestHybridRadixTreeStateful = HybridRadixMachine.TestCase
HostRadixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestHostRadixTreeStateful = HostRadixMachine.TestCase


def test_event_checks_fail_on_a_wrong_event() -> None:
    """The event assertions run in the test body, so a wrong event fails the test
    (inside a subscriber the hub would only have logged it)."""
    import pytest

    machine = RadixMachine()
    machine.setup(ps=1, policy="lru")
    machine.insert_fresh(num_pages=2, pool=[1] * 24, namespace=None, priority=0, with_state=False)
    machine.events_describe_the_tree()  # the real events pass
    machine.unchecked.append(BlockRemoved(block_hashes=[12345]))  # never stored
    with pytest.raises(AssertionError):
        machine.events_describe_the_tree()


def test_hybrid_checks_fail_on_a_wrong_state_event_or_a_lost_slot() -> None:
    import pytest

    machine = HybridRadixMachine()
    machine.setup(ps=1, policy="lru")
    machine.insert_fresh(num_pages=2, pool=[1] * 24, namespace=None, priority=0, with_state=True)
    machine.events_describe_the_tree()
    machine.every_state_slot_has_one_owner()
    assert machine.tree.total_states == 1
    machine.unchecked.append(StateRemoved(12345))  # never stored
    with pytest.raises(AssertionError):
        machine.events_describe_the_tree()
    machine.slots.free_list.pop()  # a slot leaks: nobody owns it
    with pytest.raises(AssertionError, match="owners"):
        machine.every_state_slot_has_one_owner()
