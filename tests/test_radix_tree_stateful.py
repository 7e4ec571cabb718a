"""Stateful property test: random requests drive a radix tree and a real page allocator.

Simulated requests follow the engine's life cycle: match and lock a cached prefix,
allocate pages for the rest, insert after chunks (moving the lock to the new node,
freeing the duplicates they own), then finish or abort. After every step the tree must
pass its integrity check, every page must have exactly one owner (invariant 3), locked
prefixes must still be cached (invariant 4), and the KV events must describe the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache.allocator import PageAllocator
from cache.evict_policy import EvictPolicy
from cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from cache.radix_tree import RadixTree, TreeNode
from handlers.evict_fifo import FIFO
from handlers.evict_lfu import LFU
from handlers.evict_lru import LRU
from handlers.evict_priority import PriorityLRU

NUM_PAGES = 32  # small, so eviction and refusals happen often
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

    @property
    def owned(self) -> list[int]:
        return self.table[self.cached_pages :]


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.ps = 1
        self._tree: RadixTree | None = None
        self.requests: list[Req] = []
        self.cached_hashes: set[int] = set()  # what the events say is in the tree
        self.unchecked: list[KVEvent] = []  # delivered but not yet checked

    @property
    def tree(self) -> RadixTree:
        assert self._tree is not None
        return self._tree

    @initialize(ps=st.sampled_from([1, 2, 4]), policy=st.sampled_from(sorted(POLICIES)))
    def setup(self, ps: int, policy: str) -> None:
        self.ps = ps
        self._tree = RadixTree(ps, self.alloc.free, POLICIES[policy]())
        self._tree.subscribe(self.unchecked.extend)

    def follow_events(self) -> None:
        """Check the delivered events here, in the test body: an assertion inside a
        subscriber would be caught and logged by the event hub, never failing a test."""
        events = list(self.unchecked)
        self.unchecked.clear()
        for event in events:
            if isinstance(event, BlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in self.cached_hashes
                assert self.cached_hashes.isdisjoint(event.block_hashes)
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                self.cached_hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert self.cached_hashes.issuperset(event.block_hashes)
                self.cached_hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.cached_hashes.clear()

    def tokens(self, num_pages: int, pool: list[int]) -> list[int]:
        return (pool * 4)[: num_pages * self.ps]

    def make_room(self, need: int) -> bool:
        """Evict until `need` pages are free, like the scheduler; False if locks prevent it."""
        if self.alloc.num_free < need:
            self.tree.evict(need - self.alloc.num_free)
        return self.alloc.num_free >= need

    # -- requests ------------------------------------------------------------------
    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(num_pages=page_counts, pool=token_pools, namespace=namespaces, priority=priorities)
    def start(self, num_pages: int, pool: list[int], namespace: str | None, priority: int) -> None:
        tokens = self.tokens(num_pages, pool)
        hit = self.tree.match(tokens, namespace, priority=priority)
        self.tree.lock(hit.node)  # before make_room: evict must not take the hit
        cached = hit.length // self.ps
        if not self.make_room(num_pages - cached):
            self.tree.unlock(hit.node)  # refused: waits in the queue, holds nothing
            return
        table = hit.pages + self.alloc.allocate(num_pages - cached)
        self.requests.append(Req(tokens, namespace, priority, hit.node, table, cached))

    def insert_prefix(self, req: Req, num_pages: int) -> TreeNode:
        """Cache the request's first `num_pages` pages; the tree now owns them."""
        result = self.tree.insert(
            req.tokens[: num_pages * self.ps], req.table[:num_pages], req.namespace, req.priority
        )
        duplicates = result.duplicates(req.table[:num_pages])
        assert set(duplicates) <= set(req.owned), "the tree returned pages the request does not own"
        req.table[:num_pages] = result.pages  # repoint before freeing the duplicates
        self.alloc.free(duplicates)
        req.cached_pages = num_pages
        return result.node

    @precondition(lambda self: any(r.owned for r in self.requests))
    @rule(pick=picks, cut=picks)
    def insert_chunk(self, pick: int, cut: int) -> None:
        candidates = [r for r in self.requests if r.owned]
        req = candidates[pick % len(candidates)]
        end = req.cached_pages + 1 + cut % len(req.owned)
        node = self.insert_prefix(req, end)
        self.tree.lock(node)  # lock the new node before releasing the old one
        self.tree.unlock(req.node)
        req.node = node

    @precondition(lambda self: self.requests)
    @rule(pick=picks)
    def finish(self, pick: int) -> None:
        req = self.requests.pop(pick % len(self.requests))
        self.insert_prefix(req, len(req.table))
        self.tree.unlock(req.node)

    @precondition(lambda self: self.requests)
    @rule(pick=picks)
    def abort(self, pick: int) -> None:
        req = self.requests.pop(pick % len(self.requests))
        self.alloc.free(req.owned)
        self.tree.unlock(req.node)

    @precondition(lambda self: self.requests)
    @rule(pick=picks)
    def locked_prefix_is_still_cached(self, pick: int) -> None:
        req = self.requests[pick % len(self.requests)]
        cached = req.tokens[: req.cached_pages * self.ps]
        hit = self.tree.match(cached, req.namespace, touch=False)
        assert hit.length == len(cached) and hit.pages == req.table[: req.cached_pages]

    @precondition(lambda self: any(r.cached_pages > 1 for r in self.requests))
    @rule(pick=picks, cut=picks)
    def split_a_locked_node(self, pick: int, cut: int) -> None:
        """Another prompt shares part of a running request's cached prefix."""
        candidates = [r for r in self.requests if r.cached_pages > 1]
        req = candidates[pick % len(candidates)]
        pages = 1 + cut % (req.cached_pages - 1)
        hit = self.tree.match(req.tokens[: pages * self.ps], req.namespace)
        assert hit.pages == req.table[:pages]

    # -- cache operations ------------------------------------------------------------
    @rule(num_pages=page_counts, pool=token_pools, namespace=namespaces, priority=priorities)
    def insert_fresh(self, num_pages: int, pool: list[int], namespace: str | None, priority: int) -> None:
        """A caller that computed everything itself: all fresh pages, duplicates freed after."""
        if not self.make_room(num_pages):
            return
        pages = self.alloc.allocate(num_pages)
        result = self.tree.insert(self.tokens(num_pages, pool), pages, namespace, priority)
        assert result.prefix_len % self.ps == 0
        self.alloc.free(result.duplicates(pages))

    @rule(num_pages=page_counts, pool=token_pools, namespace=namespaces, touch=st.booleans())
    def probe(self, num_pages: int, pool: list[int], namespace: str | None, touch: bool) -> None:
        hit = self.tree.match(self.tokens(num_pages, pool), namespace, touch=touch)
        assert hit.length % self.ps == 0 and len(hit.pages) == hit.length // self.ps

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

    @rule(policy=st.sampled_from(sorted(POLICIES)))
    def set_policy(self, policy: str) -> None:
        self.tree.set_policy(POLICIES[policy]())

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def tree_is_consistent(self) -> None:
        if self._tree is None:
            return
        held = [p for r in self.requests for p in r.owned]
        self.tree.check_integrity(held_pages=held)
        assert self.alloc.num_free + self.tree.total_pages + len(held) == self.alloc.num_usable
        for req in self.requests:
            assert req.node is self.tree.root or req.node.lock_ref > 0

    @invariant()
    def events_describe_the_tree(self) -> None:
        if self._tree is None:
            return
        self.follow_events()
        assert self.cached_hashes == {h for node in self.tree.nodes() for h in node.hashes}


RadixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestRadixTreeStateful = RadixMachine.TestCase


def test_event_checks_fail_on_a_wrong_event() -> None:
    """The event assertions run in the test body, so a wrong event fails the test
    (inside a subscriber the hub would only have logged it)."""
    import pytest

    machine = RadixMachine()
    machine.setup(ps=1, policy="lru")
    machine.insert_fresh(num_pages=2, pool=[1] * 24, namespace=None, priority=0)
    machine.events_describe_the_tree()  # the real events pass
    machine.unchecked.append(BlockRemoved(block_hashes=[12345]))  # never stored
    with pytest.raises(AssertionError):
        machine.events_describe_the_tree()
