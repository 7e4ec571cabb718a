"""Radix prefix cache: match/insert/split, locks, eviction policies, events, integrity check."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import structlog.testing

from cache.allocator import PageAllocator
from cache.evict_policy import EvictPolicy
from cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, page_hashes
from cache.radix_tree import InsertResult, RadixTree, TreeIntegrityError, TreeLockedError, TreeNode
from handlers.evict_fifo import FIFO
from handlers.evict_lfu import LFU
from handlers.evict_lru import LRU
from handlers.evict_priority import PriorityLRU
from kernel.registry import lookup


class Cache:
    """A tree wired to a real allocator, recording every event batch."""

    def __init__(self, page_size: int, policy: EvictPolicy | None = None, num_pages: int = 256) -> None:
        self.ps = page_size
        self.alloc = PageAllocator(num_pages)
        self.tree = RadixTree(page_size, self.alloc.free, policy or LRU())
        self.events: list[list[KVEvent]] = []
        self.tree.subscribe(self.events.append)

    def put(self, tokens: Sequence[int], namespace: str | None = None, priority: int = 0) -> InsertResult:
        """Insert like a request that computed everything itself: fresh pages, then free duplicates."""
        pages = self.alloc.allocate(len(tokens) // self.ps)
        result = self.tree.insert(tokens, pages, namespace, priority)
        self.alloc.free(result.duplicates(pages))
        return result

    def balanced(self) -> bool:
        return self.alloc.num_free + self.tree.total_pages == self.alloc.num_usable

    def flat_events(self) -> list[KVEvent]:
        return [event for batch in self.events for event in batch]


def seq(start: int, num_pages: int, ps: int) -> list[int]:
    return list(range(start, start + num_pages * ps))


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_match_covers_whole_pages_only(ps: int) -> None:
    c = Cache(ps)
    tokens = seq(100, 3, ps)
    inserted = c.put(tokens)
    assert inserted.prefix_len == 0 and len(inserted.pages) == 3

    full = c.tree.match(tokens + [7] * (ps - 1))
    assert full.length == 3 * ps and full.pages == inserted.pages and full.node is inserted.node

    partial = c.tree.match(tokens[: 2 * ps + ps // 2])  # ends inside the third page
    assert partial.length == 2 * ps and partial.pages == inserted.pages[:2]
    assert len(partial.node.key) == 2 * ps  # split at the page boundary
    assert c.tree.num_nodes == 2

    assert c.tree.match([999] * ps).length == 0
    assert c.tree.match([999] * ps).node is c.tree.root
    c.tree.check_integrity()
    assert c.balanced()


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_split_keeps_locks_hashes_and_counters(ps: int) -> None:
    c = Cache(ps)
    a = seq(0, 4, ps)
    first = c.put(a)
    c.tree.lock(first.node)
    assert c.tree.protected_pages == 4 and c.tree.evictable_pages == 0

    b = a[: 2 * ps] + seq(500, 2, ps)  # shares two pages, then diverges
    second = c.put(b)
    assert second.prefix_len == 2 * ps
    upper = first.node.parent
    assert upper is not None and upper.lock_ref == 1 and upper.pages == first.pages[:2]
    assert first.node.pages == first.pages[2:]
    assert upper.hashes + first.node.hashes == page_hashes(a, ps)
    assert c.tree.protected_pages == 4 and c.tree.evictable_pages == 2
    c.tree.check_integrity()

    c.tree.unlock(first.node)
    assert upper.lock_ref == 0 and c.tree.protected_pages == 0 and c.tree.evictable_pages == 6
    c.tree.check_integrity()


@pytest.mark.parametrize("ps", [1, 4])
def test_duplicate_insert_returns_prefix_and_leaves_duplicates_to_caller(ps: int) -> None:
    c = Cache(ps)
    tokens = seq(10, 3, ps)
    first = c.put(tokens)

    again_pages = c.alloc.allocate(3)
    again = c.tree.insert(tokens, again_pages)
    assert again.prefix_len == 3 * ps and again.node is first.node
    assert again.pages == first.pages
    assert again.duplicates(again_pages) == again_pages  # the tree took none of them
    assert c.tree.total_pages == 3
    c.alloc.free(again.duplicates(again_pages))

    # A request that matched first reuses the tree's pages: no duplicates, new pages taken.
    hit = c.tree.match(tokens)
    extended_pages = hit.pages + c.alloc.allocate(1)
    extended = c.tree.insert(tokens + seq(900, 1, ps), extended_pages)
    assert extended.prefix_len == 3 * ps and extended.duplicates(extended_pages) == []
    assert extended.pages == extended_pages and c.tree.total_pages == 4
    c.tree.check_integrity()
    assert c.balanced()


def test_insert_ending_inside_a_node_returns_a_node_ending_there() -> None:
    c = Cache(2)
    whole = c.put(seq(0, 4, 2))
    prefix = c.put(seq(0, 2, 2))
    assert prefix.prefix_len == 4 and len(prefix.node.key) == 4
    assert prefix.node.children and prefix.node is whole.node.parent
    c.tree.check_integrity()


def test_insert_rejects_ragged_input_and_page_zero() -> None:
    c = Cache(4)
    with pytest.raises(ValueError):
        c.tree.insert([1, 2, 3], [5])
    with pytest.raises(ValueError):
        c.tree.insert([1, 2, 3, 4], [5, 6])
    with pytest.raises(ValueError):
        c.tree.insert([1, 2, 3, 4], [0])
    assert c.tree.num_nodes == 0


def test_namespaces_never_share_nodes() -> None:
    c = Cache(2)
    tokens = seq(0, 2, 2)
    plain = c.put(tokens)
    alice = c.put(tokens, namespace="alice")
    assert alice.prefix_len == 0 and set(alice.pages).isdisjoint(plain.pages)
    assert c.tree.match(tokens, namespace="bob").length == 0
    assert c.tree.match(tokens, namespace="alice").pages == alice.pages
    assert c.tree.match(tokens).pages == plain.pages
    assert alice.node.hashes == page_hashes(tokens, 2, "alice")
    assert alice.node.hashes != plain.node.hashes
    assert {row["namespace"] for row in c.tree.snapshot()} == {None, "alice"}
    c.tree.check_integrity()


def test_match_counts_hits_and_access_unless_probing() -> None:
    c = Cache(1)
    node = c.put([1, 2]).node
    before = node.last_access
    c.tree.match([1, 2], touch=False)
    assert node.hit_count == 0 and node.last_access == before
    c.tree.match([1, 2, 3])
    c.tree.match([1, 2])
    assert node.hit_count == 2 and node.last_access > before


def test_lock_protects_from_eviction_and_unlock_below_zero_raises() -> None:
    c = Cache(2)
    kept = c.put(seq(0, 3, 2))
    gone = c.put(seq(100, 2, 2))
    c.tree.lock(kept.node)
    freed = c.tree.evict(100)
    assert sorted(freed) == sorted(gone.pages)
    assert c.tree.total_pages == 3 and c.tree.protected_pages == 3 and c.tree.evictable_pages == 0
    assert c.tree.evict(1) == []
    c.tree.unlock(kept.node)
    with pytest.raises(ValueError):
        c.tree.unlock(kept.node)
    assert sorted(c.tree.evict(1)) == sorted(kept.pages)  # whole node goes
    with pytest.raises(TreeLockedError):
        c.tree.lock(kept.node)  # evicted: a stale handle cannot be locked
    c.tree.check_integrity()
    assert c.balanced()


def test_parent_becomes_a_candidate_once_its_last_child_goes() -> None:
    c = Cache(1)
    c.put([1, 2, 3])
    c.put([1, 2, 4])
    assert c.tree.num_nodes == 3
    assert len(c.tree.evict(3)) == 4
    assert c.tree.num_nodes == 0 and c.tree.total_pages == 0
    c.tree.check_integrity()
    assert c.balanced()


def eviction_order(c: Cache) -> list[int]:
    """First token of each evicted single-page leaf, in order."""
    order: list[int] = []
    while c.tree.total_pages:
        before = {n.id: n.key[0] for n in c.tree.nodes()}
        c.tree.evict(1)
        after = {n.id for n in c.tree.nodes()}
        order.extend(tok for nid, tok in before.items() if nid not in after)
    return order


def test_lru_order() -> None:
    c = Cache(1, LRU())
    for tok in (1, 2, 3):
        c.put([tok])
    c.tree.match([1])
    assert eviction_order(c) == [2, 3, 1]


def test_lfu_order_breaks_ties_by_older_access() -> None:
    c = Cache(1, LFU())
    for tok in (1, 2, 3, 4):
        c.put([tok])
    for tok in (1, 1, 2, 4, 3):  # hits: 1→2, 2→1, 3→1, 4→1 ; among 1-hit: 2 oldest, then 4, then 3
        c.tree.match([tok])
    assert eviction_order(c) == [2, 4, 3, 1]


def test_fifo_order_ignores_hits() -> None:
    c = Cache(1, FIFO())
    for tok in (1, 2, 3):
        c.put([tok])
    for _ in range(3):
        c.tree.match([1])
    assert eviction_order(c) == [1, 2, 3]


def test_priority_order_then_lru() -> None:
    c = Cache(1, PriorityLRU())
    c.put([1], priority=5)
    c.put([2], priority=1)
    c.put([3], priority=1)
    c.put([4], priority=0)
    c.tree.match([2])  # 2 now more recent than 3
    c.tree.match([4], priority=9)  # used by an important request
    assert eviction_order(c) == [3, 2, 1, 4]


def test_set_policy_rebuilds_the_heap() -> None:
    c = Cache(1, LRU())
    for tok in (1, 2, 3):
        c.put([tok])
    c.tree.match([1])
    c.tree.set_policy(FIFO())
    c.tree.check_integrity()
    assert eviction_order(c) == [1, 2, 3]


@pytest.mark.parametrize("policy", [LRU, LFU, FIFO, PriorityLRU], ids=lambda p: p.__name__)
def test_heap_agrees_with_a_full_scan_under_churn(policy: type[EvictPolicy]) -> None:
    """Hundreds of nodes, random touches and locks: every victim is the scan's minimum,
    and the heap's stale entries stay bounded (swept, never compacted in one go)."""
    rng = random.Random(7)
    c = Cache(1, policy(), num_pages=600)
    locked: list[TreeNode] = []
    for step in range(3000):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        op = rng.random()
        if op < 0.35 and c.alloc.num_free >= len(tokens):
            c.put(tokens, priority=rng.randrange(3))
        elif op < 0.75:
            hit = c.tree.match(tokens, priority=rng.randrange(3))
            if rng.random() < 0.1 and hit.node is not c.tree.root:
                c.tree.lock(hit.node)
                locked.append(hit.node)
        elif op < 0.85 and locked:
            c.tree.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            leaves = [n for n in c.tree.nodes() if n.is_evictable_leaf]
            expected = min(leaves, key=lambda n: (c.tree.policy.key(n), n.id), default=None)
            freed = c.tree.evict(1)
            assert freed == (expected.pages if expected else [])
        assert len(c.tree._heap) <= 3 * c.tree.num_nodes + 8, f"heap grew unbounded at step {step}"
    c.tree.check_integrity()


def test_policies_are_registered_by_name() -> None:
    assert lookup("evict", "lru") is LRU
    assert lookup("evict", "lfu") is LFU
    assert lookup("evict", "fifo") is FIFO
    assert lookup("evict", "priority") is PriorityLRU


@pytest.mark.parametrize("namespace", [None, "tenant"])
def test_block_stored_hashes_chain_from_the_tokens(namespace: str | None) -> None:
    c = Cache(4)
    a = seq(0, 3, 4)
    b = a[:8] + seq(50, 2, 4)
    c.put(a, namespace)
    c.put(b, namespace)
    first, second = c.flat_events()
    assert first == BlockStored(page_hashes(a, 4, namespace), None, a, 4)
    expected_b = page_hashes(b, 4, namespace)
    assert isinstance(second, BlockStored)
    assert second.block_hashes == expected_b[2:] and second.parent_block_hash == expected_b[1]
    assert second.token_ids == b[8:] and second.block_size == 4


def test_block_removed_on_eviction_and_all_cleared_on_reset() -> None:
    c = Cache(2)
    a, b = seq(0, 2, 2), seq(40, 1, 2)
    c.put(a)
    c.put(b)
    c.tree.match(b)
    c.events.clear()
    c.tree.evict(1)
    assert c.events == [[BlockRemoved(page_hashes(a, 2))]]
    c.events.clear()
    c.tree.reset()
    assert c.events == [[AllBlocksCleared()]]
    assert c.tree.total_pages == 0 and c.balanced()


def test_reset_refuses_while_locked() -> None:
    c = Cache(1)
    node = c.put([1, 2]).node
    c.tree.lock(node)
    with pytest.raises(TreeLockedError):
        c.tree.reset()
    c.tree.unlock(node)
    c.tree.reset()
    assert c.balanced() and c.tree.num_nodes == 0
    with pytest.raises(TreeLockedError):
        c.tree.lock(node)


def test_failing_subscriber_does_not_fail_the_operation() -> None:
    c = Cache(1)

    def broken(events: list[KVEvent]) -> None:
        raise RuntimeError("subscriber bug")

    unsubscribe = c.tree.subscribe(broken)
    with structlog.testing.capture_logs() as logs:
        c.put([1])
    assert c.tree.total_pages == 1 and any("subscriber" in entry["event"] for entry in logs)
    unsubscribe()
    c.put([2])
    assert len(c.events) == 2


def test_strict_hub_raises_a_subscriber_failure_after_the_operation() -> None:
    """Debug runs (`debug.check_invariants`): an assertion inside a subscriber is loud."""
    alloc = PageAllocator(16)
    tree = RadixTree(1, alloc.free, LRU(), strict_events=True)
    seen: list[int] = []

    def asserting(events: list[KVEvent]) -> None:
        raise AssertionError("a subscriber's assertion")

    tree.subscribe(asserting)
    tree.subscribe(lambda events: seen.append(len(events)))
    with pytest.raises(AssertionError, match="subscriber's assertion"):
        tree.insert([1], alloc.allocate(1))
    assert tree.total_pages == 1, "the operation completed before the error was raised"
    assert seen == [1], "later subscribers still got the events"


def planted_tree() -> Cache:
    c = Cache(2)
    c.put(seq(0, 3, 2))
    c.put(seq(0, 1, 2) + seq(70, 1, 2))
    c.tree.check_integrity()
    return c


def leaf(c: Cache) -> TreeNode:
    return next(n for n in c.tree.nodes() if not n.children)


def drop_page(c: Cache) -> None:
    leaf(c).pages.pop()


def use_page_zero(c: Cache) -> None:
    leaf(c).pages[0] = 0


def share_a_page(c: Cache) -> None:
    other = next(n for n in c.tree.nodes() if n is not leaf(c))
    leaf(c).pages[0] = other.pages[0]


def negative_lock(c: Cache) -> None:
    leaf(c).lock_ref = -1


def lose_heap_entry(c: Cache) -> None:
    leaf(c).heap_version += 1  # its heap entry goes stale: it would never be evicted


def corrupt_hash(c: Cache) -> None:
    leaf(c).hashes[0] ^= 1


def miscount(c: Cache) -> None:
    c.tree._total += 1


PLANTS: dict[str, tuple[Callable[[Cache], None], str]] = {
    "dropped-page": (drop_page, "pages"),
    "page-zero": (use_page_zero, "page 0"),
    "shared-page": (share_a_page, "twice"),
    "negative-lock": (negative_lock, "lock"),
    "missing-from-heap": (lose_heap_entry, "heap"),
    "bad-hash": (corrupt_hash, "hash"),
    "counter": (miscount, "counters"),
}


@pytest.mark.parametrize("name", list(PLANTS))
def test_planted_bugs_make_the_check_fail(name: str) -> None:
    """The guard is only trusted once shown to fail: plant each bug, watch it go red."""
    plant, message = PLANTS[name]
    c = planted_tree()
    plant(c)
    with pytest.raises(TreeIntegrityError, match=message):
        c.tree.check_integrity()


def test_held_pages_must_not_be_tree_pages() -> None:
    c = planted_tree()
    tree_page = next(c.tree.nodes()).pages[0]
    with pytest.raises(TreeIntegrityError, match="both"):
        c.tree.check_integrity(held_pages=[tree_page])
