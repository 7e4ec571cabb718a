"""Host-tier residency in the radix tree: write-through copies, device eviction that keeps
a prefix matchable from host, load-back (`restore`), host eviction, locks, splits of
host-only nodes, reset, events, pages fetched from storage (`insert_host`), and planted
bugs the checks must catch.

The harness simulates KV content: every device page and host page records the chained
hash of the tokens it holds, so a match that lends the wrong page (a host copy on the
wrong node, shifted by one) fails `served` even where the counts all agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from cache.allocator import PageAllocator
from cache.evict_policy import EvictPolicy
from cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, StateRemoved, page_hashes
from cache.prefix_cache import NoPrefixCache
from cache.radix_host import TreeHost
from cache.radix_node import MatchResult
from cache.radix_tree import InsertResult, RadixTree, TreeIntegrityError, TreeLockedError, TreeNode
from handlers.evict_lru import LRU


class HostPages:
    """A host page free list (id 0 reserved) that refuses double frees."""

    def __init__(self, size: int) -> None:
        self.num_usable = size - 1
        self.free_list: list[int] = list(range(size - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_list), "host pool exhausted"
        return [self.free_list.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        for page in pages:
            assert page != 0 and page not in self.free_list, f"host page {page} freed twice"
            self.free_list.append(page)


class Tiered:
    """A tiered tree wired to a page allocator, a host free list, simulated KV content,
    and (hybrid) a state-slot free list; records every event."""

    def __init__(self, ps: int = 2, policy: EvictPolicy | None = None, hybrid: bool = False) -> None:
        self.ps = ps
        self.alloc = PageAllocator(64)
        self.host = HostPages(64)
        self.slots = HostPages(16)
        self.kv: dict[int, int] = {}  # device page -> hash of the tokens it holds
        self.host_kv: dict[int, int] = {}  # host page -> hash of the tokens it holds
        free_states = self.slots.free if hybrid else None
        self.tree = RadixTree(
            ps, self.alloc.free, policy or LRU(), free_states=free_states, free_host_pages=self.host.free
        )
        self.events: list[KVEvent] = []
        self.tree.subscribe(self.events.extend)

    def put(self, tokens: Sequence[int], namespace: str | None = None, state: bool = False) -> InsertResult:
        """Insert like a request that computed everything itself (hybrid: with a state slot)."""
        pages = self.alloc.allocate(len(tokens) // self.ps)
        assert pages is not None
        for page, h in zip(pages, page_hashes(tokens, self.ps, namespace)):
            self.kv[page] = h
        slot = self.slots.allocate(1)[0] if state else None
        result = self.tree.insert(tokens, pages, namespace, state_slot=slot)
        self.alloc.free(result.duplicates(pages))
        if result.duplicate_state is not None:
            self.slots.free([result.duplicate_state])
        return result

    def copy(self, node: TreeNode) -> list[int]:
        """Write-through: lock, copy the device pages to fresh host pages, mark, unlock."""
        self.tree.lock(node)
        host = self.host.allocate(len(node.pages))
        for page, h in zip(node.pages, host):
            self.host_kv[h] = self.kv[page]
        self.tree.mark_host(node, host)
        self.tree.unlock(node)
        return host

    def load(self, hit: MatchResult) -> list[int]:
        """Load a match's host part back as a request would: lock, allocate, copy, restore, unlock."""
        assert hit.host_node is not None
        self.tree.lock(hit.host_node)
        pages = self.alloc.allocate(len(hit.host_pages))
        assert pages is not None
        for page, h in zip(pages, hit.host_pages):
            self.kv[page] = self.host_kv[h]
        self.tree.restore(hit.host_node, pages)
        self.tree.unlock(hit.host_node)
        return pages

    def served(self, tokens: Sequence[int], namespace: str | None = None) -> MatchResult:
        """Match (no touch) and check every lent page holds the KV of its tokens."""
        hit = self.tree.match(tokens, namespace, touch=False)
        hashes = page_hashes(tokens, self.ps, namespace)
        n, m = len(hit.pages), len(hit.host_pages)
        assert hit.length == n * self.ps and hit.host_length == m * self.ps
        assert [self.kv[p] for p in hit.pages] == hashes[:n], "a device page holds other tokens"
        assert [self.host_kv[h] for h in hit.host_pages] == hashes[n : n + m], (
            "a host page holds other tokens"
        )
        return hit

    def check(self) -> None:
        self.tree.check_integrity()
        assert self.alloc.num_free + self.tree.total_pages == self.alloc.num_usable
        assert self.host.num_free + self.tree.total_host_pages == self.host.num_usable

    def take_events(self) -> list[KVEvent]:
        events = list(self.events)
        self.events.clear()  # the subscriber extends this very list
        return events


def seq(start: int, num_pages: int, ps: int = 2) -> list[int]:
    return list(range(start, start + num_pages * ps))


def test_write_through_then_device_eviction_keeps_the_prefix_matchable() -> None:
    t = Tiered()
    tokens = seq(100, 3)
    node = t.put(tokens).node
    device = list(node.pages)
    host = t.copy(node)
    assert node.tier == "device+host" and t.tree.total_host_pages == 3 == t.tree.evictable_host_pages
    t.check()

    assert t.tree.evict(1) == device  # the whole node's device pages go, the copy stays
    assert node.tier == "host" and node.parent is t.tree.root and t.tree.total_pages == 0
    t.check()
    hit = t.served(tokens + [7])
    assert (hit.length, hit.pages, hit.node) == (0, [], t.tree.root)
    assert hit.host_length == 6 and hit.host_pages == host and hit.host_node is node
    assert hit.kv_length == 6 and hit.lost_tokens == 0

    loaded = t.load(hit)
    assert node.tier == "device+host" and node.pages == loaded and node.host_pages == host
    again = t.served(tokens)
    assert again.length == 6 and again.pages == loaded and again.host_length == 0 and again.host_node is None
    t.check()

    t.take_events()
    assert t.tree.evict(3) == loaded  # a second device eviction needs no copy: the copy is kept
    assert node.tier == "host" and node.host_pages == host and t.tree.total_host_pages == 3
    assert t.take_events() == [BlockRemoved(node.hashes, medium="device")]
    t.check()


def test_a_device_only_node_goes_with_its_host_only_descendants() -> None:
    t = Tiered()
    parent = t.put(seq(0, 2)).node
    child = t.put(seq(0, 2) + seq(50, 2)).node
    t.copy(child)
    child_pages = list(child.pages)
    assert t.tree.evict(1) == child_pages  # the leaf first: it keeps its copy
    assert child.tier == "host" and parent.is_evictable_leaf  # no device child left
    t.check()
    t.take_events()
    freed_host = list(child.host_pages or [])
    assert t.tree.evict(1) == parent.pages  # no copy: removed, and the host-only child with it
    assert parent.parent is None and child.parent is None and t.tree.num_nodes == 0
    assert t.tree.total_host_pages == 0 and set(freed_host) <= set(t.host.free_list)
    assert t.take_events() == [BlockRemoved(parent.hashes + child.hashes)]
    assert t.served(seq(0, 4)).host_length == 0
    t.check()


def test_host_eviction_order_leaves_and_device_nodes() -> None:
    t = Tiered()
    a = t.put(seq(0, 2)).node  # oldest
    b = t.put(seq(0, 2) + seq(40, 1)).node  # a's child
    c = t.put(seq(90, 1)).node  # newest, stays device+host
    for node in (a, b, c):
        t.copy(node)
    t.tree.evict(3)  # b then a demoted (a has no device child once b is host-only)
    assert (a.tier, b.tier, c.tier) == ("host", "host", "device+host")
    assert t.tree.evictable_host_pages == 4
    t.check()
    t.take_events()

    # a is host-only with a child: not a candidate; b (host-only leaf, older) goes first.
    b_hashes, b_host = list(b.hashes), list(b.host_pages or [])
    assert t.tree.evict_host(1) == b_host
    assert b.parent is None and a.children == {} and t.tree.evictable_host_pages == 3
    assert t.take_events() == [BlockRemoved(b_hashes)]
    t.check()
    a_host = list(a.host_pages or [])
    assert t.tree.evict_host(1) == a_host  # a is a host-only leaf now
    c_host = list(c.host_pages or [])
    assert c_host and t.tree.evict_host(5) == c_host
    assert c.tier == "device" and c.parent is t.tree.root
    assert t.tree.total_host_pages == 0 == t.tree.evictable_host_pages
    assert t.take_events()[-1] == BlockRemoved(c.hashes, medium="host")
    assert t.served(seq(90, 1)).length == 2  # c kept its device pages
    assert t.tree.evict_host(1) == []
    t.check()


def test_host_eviction_of_a_device_and_host_node_keeps_its_device_pages() -> None:
    t = Tiered()
    node = t.put(seq(0, 3)).node
    host = t.copy(node)
    t.take_events()
    assert t.tree.evict_host(1) == host and node.host_pages is None and node.tier == "device"
    assert t.take_events() == [BlockRemoved(node.hashes, medium="host")]
    assert t.served(seq(0, 3)).length == 6
    assert t.host.num_free == t.host.num_usable
    t.check()


def test_locked_nodes_lose_nothing() -> None:
    t = Tiered()
    node = t.put(seq(0, 2)).node
    host = t.copy(node)
    t.tree.lock(node)
    assert t.tree.evict(10) == [] and t.tree.evict_host(10) == [] and t.tree.evictable_host_pages == 0
    with pytest.raises(TreeLockedError):
        t.tree.reset()
    t.tree.unlock(node)
    t.tree.evict(1)
    hit = t.served(seq(0, 2))
    assert hit.host_node is node
    t.tree.lock(node)  # a load-back in flight: the host-only node keeps its copy
    assert t.tree.protected_pages == 0 and t.tree.evictable_host_pages == 0
    assert t.tree.evict_host(10) == [] and node.host_pages == host
    with pytest.raises(TreeLockedError, match="host"):
        t.tree.reset()  # nothing device is locked, but a host copy is
    t.check()
    t.tree.unlock(node)
    assert t.tree.evict_host(10) == host and node.parent is None
    t.check()


def test_a_split_of_a_host_only_node_splits_its_host_pages() -> None:
    t = Tiered()
    tokens = seq(0, 4)
    node = t.put(tokens).node
    host = t.copy(node)
    t.tree.evict(1)
    hit = t.served(tokens[:4] + [99, 98])  # ends inside the host-only node: split after 2 pages
    assert hit.host_length == 4 and hit.host_pages == host[:2]
    upper = hit.host_node
    assert upper is not None and upper is node.parent and upper.tier == "host" and node.tier == "host"
    assert upper.host_pages == host[:2] and node.host_pages == host[2:]
    t.check()
    assert t.served(tokens).host_pages == host

    # An insert through the host-only upper: it adopts the caller's pages (device+host),
    # keeping device-resident nodes a top subtree; the lower half stays host-only.
    t.take_events()
    inserted = t.put(tokens[:4] + seq(70, 1))
    assert inserted.prefix_len == 0 and upper.tier == "device+host" and node.tier == "host"
    assert inserted.pages[:2] == upper.pages and inserted.node.parent is upper
    stored = [e for e in t.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [upper.hashes, inserted.node.hashes]
    assert all(e.medium is None for e in stored)
    hit = t.served(tokens)
    assert (hit.length, hit.host_length, hit.host_pages) == (4, 4, host[2:])
    t.check()


def test_a_split_of_a_device_and_host_node_splits_both_lists() -> None:
    t = Tiered()
    node = t.put(seq(0, 3)).node
    device, host = list(node.pages), t.copy(node)
    t.put(seq(0, 1) + seq(50, 1))  # splits after one page
    upper = node.parent
    assert upper is not None and upper.pages == device[:1] and upper.host_pages == host[:1]
    assert node.pages == device[1:] and node.host_pages == host[1:]
    t.check()
    t.tree.evict(10)  # the new leaf (no copy) goes, node and then upper keep their copies
    assert (upper.tier, node.tier, len(upper.children)) == ("host", "host", 1)
    hit = t.served(seq(0, 3))
    assert hit.host_pages == host and hit.host_node is node
    t.check()


def test_restore_refuses_a_wrong_count_or_a_path_no_longer_host_resident() -> None:
    t = Tiered()
    tokens = seq(0, 2)
    node = t.put(tokens).node
    t.copy(node)
    t.tree.evict(1)
    hit = t.served(tokens)
    t.tree.lock(node)
    pages = t.alloc.allocate(3)
    assert pages is not None
    with pytest.raises(ValueError, match="3 device pages"):
        t.tree.restore(node, pages)
    assert node.tier == "host" and t.tree.total_pages == 0
    with pytest.raises(ValueError, match="page 0"):
        t.tree.restore(node, [0, pages[0]])
    t.put(tokens)  # another request computed the same tokens: the node adopts its pages
    assert node.tier == "device+host" and hit.host_node is node
    with pytest.raises(ValueError, match="no longer host-resident"):
        t.tree.restore(node, pages[:2])  # the load-back lost the race: its pages are still its own
    t.alloc.free(pages)
    t.tree.unlock(node)
    t.check()


def test_mark_host_refuses_callers_bugs() -> None:
    t = Tiered()
    node = t.put(seq(0, 2)).node
    with pytest.raises(ValueError, match="2 device pages"):
        t.tree.mark_host(node, [5])
    with pytest.raises(ValueError, match="reserved"):
        t.tree.mark_host(node, [0, 5])
    t.copy(node)
    with pytest.raises(ValueError, match="already"):
        t.tree.mark_host(node, [7, 8])
    t.tree.evict(1)
    assert node.tier == "host"
    with pytest.raises(ValueError, match="already"):
        t.tree.mark_host(node, [7, 8])
    t.check()

    dense = RadixTree(2, PageAllocator(8).free, LRU())
    with pytest.raises(ValueError, match="host tier"):
        dense.mark_host(t.tree.root, [1])
    with pytest.raises(ValueError, match="host tier"):
        dense.restore(t.tree.root, [1])
    assert not dense.tiered and dense.evict_host(5) == [] and dense.total_host_pages == 0


def test_a_copy_split_in_flight_is_refused() -> None:
    t = Tiered()
    node = t.put(seq(0, 3)).node
    t.tree.lock(node)
    host = t.host.allocate(3)
    t.put(seq(0, 1) + seq(50, 1))  # a match/insert splits the node while it is copied
    with pytest.raises(ValueError, match="3 host pages"):
        t.tree.mark_host(node, host)
    t.host.free(host)
    t.tree.unlock(node)
    t.check()


def test_reset_frees_host_copies() -> None:
    t = Tiered()
    a = t.put(seq(0, 2)).node
    b = t.put(seq(0, 2) + seq(10, 2)).node
    t.copy(a)
    t.copy(b)
    t.tree.evict(2)
    t.take_events()
    t.tree.reset()
    assert t.tree.total_host_pages == 0 and t.host.num_free == t.host.num_usable
    assert t.alloc.num_free == t.alloc.num_usable and t.take_events() == [AllBlocksCleared()]
    assert a.parent is None and b.parent is None
    t.check()


def test_events_name_the_medium() -> None:
    t = Tiered()
    node = t.put(seq(0, 2)).node
    t.copy(node)
    t.tree.evict(1)
    hit = t.served(seq(0, 2))
    t.load(hit)
    t.tree.evict_host(1)
    t.tree.evict(1)
    h, toks = node.hashes, seq(0, 2)
    assert t.take_events() == [
        BlockStored(h, None, toks, 2),
        BlockStored(h, None, toks, 2, medium="host"),
        BlockRemoved(h, medium="device"),
        BlockStored(h, None, toks, 2),  # restore: the device copy is back
        BlockRemoved(h, medium="host"),
        BlockRemoved(h),  # the last copy: gone from the cache
    ]


def test_snapshot_shows_tier_and_host_pages() -> None:
    t = Tiered()
    a = t.put(seq(0, 2)).node
    b = t.put(seq(20, 1)).node
    t.copy(a)
    t.copy(b)
    t.tree.evict(1)  # LRU: a (older) goes to host
    rows = {row["id"]: row for row in t.tree.snapshot()}
    assert rows[t.tree.root.id]["tier"] == "device"
    assert (rows[a.id]["tier"], rows[a.id]["num_pages"], rows[a.id]["num_host_pages"]) == ("host", 0, 2)
    assert (rows[b.id]["tier"], rows[b.id]["num_host_pages"]) == ("device+host", 1)


def test_hybrid_host_part_stops_at_the_deepest_host_node_with_a_state() -> None:
    t = Tiered(hybrid=True)
    a = t.put(seq(0, 2), state=True).node
    b = t.put(seq(0, 2) + seq(30, 1), state=True).node
    c = t.put(seq(0, 2) + seq(30, 2), state=False).node  # a tombstone below b
    for node in (a, b, c):
        t.copy(node)
    t.tree.evict(2)  # c then b: a keeps its device pages
    assert (a.tier, b.tier, c.tier) == ("device+host", "host", "host")
    assert b.state_slot is not None, "a host-only node keeps its state slot"
    hit = t.served(seq(0, 2) + seq(30, 2))
    assert (hit.length, hit.state_slot, hit.host_length, hit.host_node) == (4, a.state_slot, 2, b)
    assert hit.lost_tokens == 2 and hit.kv_length == 8
    t.check()

    # A device part trimmed back (a tombstone at its end) offers no host part.
    a_slot = a.state_slot
    assert t.tree.evict_states(1) == [a_slot]  # LRU tie with b: the lower id goes first
    assert a.state_slot is None and b.state_slot is not None
    t.check()
    hit = t.served(seq(0, 2) + seq(30, 2))
    assert (hit.length, hit.host_length, hit.host_node, hit.lost_tokens) == (0, 0, None, 8)

    # A host-only leaf evicted from host takes its slot with it (StateRemoved first).
    t.take_events()
    b_slot, b_hashes, c_hashes, a_hashes = b.state_slot, list(b.hashes), list(c.hashes), list(a.hashes)
    assert t.tree.evict_host(10)  # a's copy, c, then b (a leaf once c is gone) with its slot
    assert (a.tier, b.parent, c.parent) == ("device", None, None) and b_slot in t.slots.free_list
    assert t.take_events() == [
        StateRemoved(b_hashes[-1]),
        BlockRemoved(c_hashes + b_hashes),
        BlockRemoved(a_hashes, medium="host"),
    ]
    assert t.slots.num_free + t.tree.total_states == t.slots.num_usable
    t.check()


def test_a_tree_without_a_host_tier_reports_no_host_part() -> None:
    alloc = PageAllocator(16)
    tree = RadixTree(2, alloc.free, LRU())
    tree.insert(seq(0, 2), alloc.allocate(2) or [])
    hit = tree.match(seq(0, 2))
    assert (hit.host_length, hit.host_pages, hit.host_node, hit.kv_length) == (0, [], None, 4)
    none = NoPrefixCache(2)
    assert not none.tiered and none.total_host_pages == 0 and none.evict_host(3) == []
    none.check_integrity(held_host_pages=[1])
    with pytest.raises(ValueError):
        none.mark_host(none.match([1, 2]).node, [1])
    with pytest.raises(ValueError):
        none.restore(none.match([1, 2]).node, [1])


def test_held_host_pages_must_not_be_tree_pages() -> None:
    t = Tiered()
    node = t.put(seq(0, 2)).node
    host = t.copy(node)
    with pytest.raises(TreeIntegrityError, match="both"):
        t.tree.check_integrity(held_host_pages=[host[0]])
    with pytest.raises(TreeIntegrityError, match="twice"):
        t.tree.check_integrity(held_host_pages=[60, 60])


# -- insert_host: pages fetched from storage into host pages ----------------------------
def fetched(t: Tiered, tokens: Sequence[int], first: int, namespace: str | None = None) -> list[int]:
    """Fresh host pages a storage fetch filled with pages `first`, `first + 1`, ... of
    `tokens` (the caller's until `insert_host` takes them)."""
    host = t.host.allocate(len(tokens) // t.ps - first)
    for h, page_hash in zip(host, page_hashes(tokens, t.ps, namespace)[first:]):
        t.host_kv[h] = page_hash
    return host


def insert_fetched(
    t: Tiered, tokens: Sequence[int], first: int, namespace: str | None = None
) -> tuple[TreeNode | None, list[int], list[int]]:
    """Fetch pages `first`.. of `tokens` into fresh host pages and `insert_host` them, as
    the storage tier does; checks the tree while the caller still holds the duplicates,
    then frees them. Returns (leaf, the host pages fetched, the duplicates)."""
    host = fetched(t, tokens, first, namespace)
    leaf, dupes = t.tree.insert_host(tokens, host, namespace)
    assert len(set(dupes)) == len(dupes) and set(dupes) <= set(host)
    taken = leaf.host_pages if leaf is not None else []
    assert sorted([*dupes, *(taken or [])]) == sorted(host), "a host page neither taken nor returned"
    t.tree.check_integrity(held_host_pages=dupes)
    t.host.free(dupes)
    t.check()
    return leaf, host, dupes


def host_stored(events: list[KVEvent]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == "host"]


def test_insert_host_under_the_root_is_a_stored_host_only_leaf() -> None:
    t = Tiered()
    tokens = seq(100, 3)
    leaf, host, dupes = insert_fetched(t, tokens, 0)
    assert leaf is not None and dupes == []
    assert leaf.parent is t.tree.root and leaf.key == tuple(tokens) and leaf.tier == "host"
    assert leaf.host_pages == host and leaf.pages == [] and leaf.stored and leaf.lock_ref == 0
    assert (t.tree.num_nodes, t.tree.total_pages, t.tree.total_host_pages) == (1, 0, 3)
    assert t.tree.evictable_host_pages == 3 and t.tree.root.device_children == 0
    assert leaf.hashes == page_hashes(tokens, 2)
    hit = t.served(tokens + [7])
    assert (hit.length, hit.pages, hit.node) == (0, [], t.tree.root)
    assert (hit.host_length, hit.host_pages, hit.host_node) == (6, host, leaf)
    assert t.take_events() == [BlockStored(page_hashes(tokens, 2), None, tokens, 2, medium="host")]


def test_insert_host_under_a_device_node_then_restore() -> None:
    t = Tiered()
    parent = t.put(seq(0, 2)).node
    tokens = seq(0, 2) + seq(50, 2)
    t.take_events()
    leaf, host, dupes = insert_fetched(t, tokens, 2)
    assert leaf is not None and dupes == [] and leaf.parent is parent and leaf.host_pages == host
    assert parent.device_children == 0 and parent.is_evictable_leaf, "a host-only child is no device child"
    assert t.take_events() == [
        BlockStored(page_hashes(tokens, 2)[2:], parent.hash, seq(50, 2), 2, medium="host")
    ]
    hit = t.served(tokens)
    assert (hit.length, hit.node, hit.pages) == (4, parent, parent.pages)
    assert (hit.host_length, hit.host_pages, hit.host_node) == (4, host, leaf)
    loaded = t.load(hit)
    assert leaf.tier == "device+host" and leaf.pages == loaded and leaf.host_pages == host and leaf.stored
    assert parent.device_children == 1 and not parent.is_evictable_leaf
    assert t.take_events() == [BlockStored(leaf.hashes, parent.hash, seq(50, 2), 2)]
    again = t.served(tokens)
    assert again.length == 8 and again.host_length == 0 and again.host_node is None
    t.check()
    assert t.tree.evict(2) == loaded and leaf.tier == "host"  # the copy keeps it matchable
    t.check()


def test_insert_host_under_a_host_only_node() -> None:
    t = Tiered()
    parent = t.put(seq(0, 2)).node
    parent_host = t.copy(parent)
    t.tree.evict(1)
    assert parent.tier == "host" and parent.is_host_candidate
    tokens = seq(0, 2) + seq(60, 1)
    leaf, host, dupes = insert_fetched(t, tokens, 2)
    assert leaf is not None and dupes == [] and leaf.parent is parent and leaf.tier == "host"
    assert not parent.is_host_candidate, "a host-only node with a child stays until the child goes"
    hit = t.served(tokens)
    assert (hit.length, hit.host_length, hit.host_pages) == (0, 6, parent_host + host)
    assert hit.host_node is leaf
    loaded = t.load(hit)  # the whole host-only path comes back at once (top subtree)
    assert parent.pages == loaded[:2] and leaf.pages == loaded[2:]
    assert (parent.tier, leaf.tier) == ("device+host", "device+host")
    t.check()


def test_insert_host_returns_exactly_the_pages_the_tree_already_holds() -> None:
    t = Tiered()
    node = t.put(seq(0, 2)).node
    tokens = seq(0, 2) + seq(50, 2)
    leaf, host, dupes = insert_fetched(t, tokens, 0)  # fetched from the start: 2 overlap
    assert dupes == host[:2] and leaf is not None and leaf.host_pages == host[2:]
    assert leaf.parent is node and node.host_pages is None, "the tree keeps its own copy"
    assert t.served(tokens).host_pages == host[2:]
    assert all(h in t.host.free_list for h in dupes)


def test_insert_host_overlapping_into_a_node_splits_it() -> None:
    t = Tiered()
    node = t.put(seq(0, 3)).node  # pages [0 1] [2 3] [4 5]
    tokens = seq(0, 2) + seq(50, 2)  # shares two pages, then diverges
    t.take_events()
    leaf, host, dupes = insert_fetched(t, tokens, 1)  # host pages for pages 1, 2, 3
    upper = node.parent
    assert upper is not None and upper is not t.tree.root and upper.key == tuple(seq(0, 2))
    assert dupes == host[:1] and leaf is not None and leaf.host_pages == host[1:] and leaf.parent is upper
    assert not upper.stored and not node.stored  # only the fetched leaf is known to be stored
    assert host_stored(t.take_events()) == [
        BlockStored(page_hashes(tokens, 2)[2:], upper.hash, seq(50, 2), 2, medium="host")
    ]
    assert t.served(tokens).host_pages == host[1:]


def test_insert_host_with_a_gap_takes_nothing() -> None:
    t = Tiered()
    t.put(seq(0, 1))
    tokens = seq(0, 1) + seq(50, 3)
    before = (t.tree.snapshot(), t.tree.total_host_pages, t.tree.num_nodes)
    t.take_events()
    leaf, host, dupes = insert_fetched(t, tokens, 2)  # page 1 is nowhere in the tree
    assert leaf is None and dupes == host
    assert (t.tree.total_host_pages, t.tree.num_nodes) == before[1:] and t.take_events() == []
    assert t.tree.snapshot() == before[0]
    assert t.served(tokens).host_length == 0

    # A gap inside a node: the walk still splits it (like a match), nothing is taken.
    t2 = Tiered()
    node = t2.put(seq(0, 3)).node
    tokens = seq(0, 1) + seq(50, 3)
    leaf, host, dupes = insert_fetched(t2, tokens, 2)
    assert leaf is None and dupes == host and t2.tree.total_host_pages == 0
    assert node.parent is not None and t2.served(seq(0, 3)).length == 6


def test_insert_host_of_pages_all_present_takes_nothing() -> None:
    t = Tiered()
    node = t.put(seq(0, 3)).node
    t.take_events()
    leaf, host, dupes = insert_fetched(t, seq(0, 3), 1)
    assert leaf is None and dupes == host and t.tree.num_nodes == 1 and t.take_events() == []
    leaf, host, dupes = insert_fetched(t, seq(0, 2), 0)  # a prefix of a node: split, all present
    assert leaf is None and dupes == host
    upper = node.parent
    assert upper is not None and upper.parent is t.tree.root
    t.copy(upper)
    t.copy(node)
    t.tree.evict(10)  # present on host only counts as present too
    assert t.tree.total_pages == 0 and (upper.tier, node.tier) == ("host", "host")
    leaf, host, dupes = insert_fetched(t, seq(0, 3), 0)
    assert leaf is None and dupes == host and t.tree.total_host_pages == 3
    leaf, dupes = t.tree.insert_host(seq(0, 3), [])  # nothing fetched at all
    assert (leaf, dupes) == (None, [])
    t.check()


def test_an_inserted_host_leaf_is_a_host_eviction_candidate() -> None:
    t = Tiered()
    device = t.put(seq(0, 2)).node
    tokens = seq(0, 2) + seq(30, 2)
    leaf, host, _ = insert_fetched(t, tokens, 2)
    assert leaf is not None and leaf.is_host_candidate and t.tree.evictable_host_pages == 2
    t.tree.lock(leaf)  # a load-back in flight keeps it
    assert t.tree.evictable_host_pages == 0 and t.tree.evict_host(5) == [] and leaf.parent is device
    t.tree.unlock(leaf)
    hashes = list(leaf.hashes)
    t.take_events()
    assert t.tree.evict_host(1) == host
    assert leaf.parent is None and device.children == {} and t.tree.num_nodes == 1
    assert t.take_events() == [BlockRemoved(hashes)]  # its last copy: gone from the cache
    assert t.tree.total_host_pages == 0 and t.host.num_free == t.host.num_usable
    assert t.served(tokens).host_length == 0
    t.check()


def test_a_device_only_parent_evicted_takes_the_inserted_host_leaf_along() -> None:
    t = Tiered()
    parent = t.put(seq(0, 2)).node
    leaf, host, _ = insert_fetched(t, seq(0, 2) + seq(30, 2), 2)
    assert leaf is not None
    t.take_events()
    assert t.tree.evict(1) == parent.pages
    assert leaf.parent is None and t.tree.num_nodes == 0 and all(h in t.host.free_list for h in host)
    assert t.take_events() == [BlockRemoved(parent.hashes + leaf.hashes)]
    t.check()


def test_insert_host_hashes_are_the_storage_keys_in_a_namespace() -> None:
    t = Tiered()
    tokens = seq(0, 2) + seq(40, 2)
    t.put(seq(0, 2), namespace="a")
    t.take_events()
    # Another namespace holds nothing of it: a fetch from page 2 has a gap there.
    leaf, _, dupes = insert_fetched(t, tokens, 2, namespace="b")
    assert leaf is None and len(dupes) == 2
    leaf, host, dupes = insert_fetched(t, tokens, 2, namespace="a")
    assert leaf is not None and dupes == [] and leaf.namespace == "a"
    assert leaf.hashes == page_hashes(tokens, 2, "a")[2:] != page_hashes(tokens, 2)[2:]
    (event,) = host_stored(t.take_events())
    assert event.block_hashes == page_hashes(tokens, 2, "a")[2:]
    assert event.parent_block_hash == page_hashes(tokens, 2, "a")[1] and event.token_ids == seq(40, 2)
    assert t.served(tokens, "a").host_pages == host
    assert t.served(tokens).host_length == 0 and t.served(tokens, "b").host_length == 0

    # Under the root of a namespace: the first page chains from the namespace seed.
    leaf, host, _ = insert_fetched(t, seq(90, 2), 0, namespace="b")
    assert leaf is not None and leaf.parent is t.tree.root and leaf.namespace == "b"
    (event,) = host_stored(t.take_events())
    assert event.parent_block_hash is None and event.block_hashes == page_hashes(seq(90, 2), 2, "b")
    assert t.served(seq(90, 2), "b").host_pages == host and t.served(seq(90, 2)).host_length == 0


def test_insert_host_refuses_callers_bugs_changing_nothing() -> None:
    t = Tiered()
    t.put(seq(0, 2))
    t.take_events()
    before = (t.tree.snapshot(), t.tree.total_host_pages, t.tree.num_nodes, t.tree._clock)
    cases = [
        (seq(0, 2) + [9], [5], "whole pages"),  # 5 tokens: not whole pages
        (seq(0, 2), [5, 6, 7], "whole pages"),  # more host pages than pages
        (seq(0, 2) + seq(20, 2), [0, 5], "reserved"),
        (seq(0, 2) + seq(20, 2), [5, 5], "distinct"),
    ]
    for tokens, host, message in cases:
        with pytest.raises(ValueError, match=message):
            t.tree.insert_host(tokens, host)
        assert (t.tree.snapshot(), t.tree.total_host_pages, t.tree.num_nodes, t.tree._clock) == before
        assert t.take_events() == []
        t.tree.check_integrity(held_host_pages=sorted(set(host) - {0}))

    hybrid = Tiered(hybrid=True)
    hybrid.put(seq(0, 2), state=True)
    rows = hybrid.tree.snapshot()
    with pytest.raises(ValueError, match="hybrid"):
        hybrid.tree.insert_host(seq(0, 2) + seq(20, 1), [5])
    assert hybrid.tree.snapshot() == rows and hybrid.tree.total_host_pages == 0
    hybrid.tree.check_integrity(held_host_pages=[5])

    alloc = PageAllocator(8)
    dense = RadixTree(2, alloc.free, LRU())
    dense.insert(seq(0, 2), alloc.allocate(2) or [])
    rows = dense.snapshot()
    with pytest.raises(ValueError, match="host tier"):
        dense.insert_host(seq(0, 2) + seq(20, 1), [5])
    assert dense.snapshot() == rows
    dense.check_integrity(held_host_pages=[5])
    with pytest.raises(ValueError, match="host tier"):
        NoPrefixCache(2).insert_host(seq(0, 1), [5])


def test_stored_survives_a_split_and_shows_in_describe() -> None:
    t = Tiered()
    leaf, host, _ = insert_fetched(t, seq(0, 4), 0)
    assert leaf is not None and leaf.describe()["stored"] is True
    hit = t.served(seq(0, 2))  # ends inside the leaf: split after 2 pages
    upper = hit.host_node
    assert upper is not None and upper is leaf.parent and upper is not leaf
    assert upper.stored and leaf.stored and upper.host_pages == host[:2] and leaf.host_pages == host[2:]
    rows = {row["id"]: row for row in t.tree.snapshot()}
    assert rows[upper.id]["stored"] is True and rows[leaf.id]["stored"] is True
    assert rows[t.tree.root.id]["stored"] is False
    other = t.put(seq(90, 1)).node
    assert rows.get(other.id) is None and other.describe()["stored"] is False
    t.check()
    # A request that computes the same tokens itself makes the stored leaf device+host.
    inserted = t.put(seq(0, 4))
    assert inserted.prefix_len == 0 and (upper.tier, leaf.tier) == ("device+host", "device+host")
    assert upper.stored and leaf.stored
    t.check()


# -- planted bugs ------------------------------------------------------------------------
def two_level(t: Tiered) -> tuple[TreeNode, TreeNode]:
    parent = t.put(seq(0, 2)).node
    child = t.put(seq(0, 2) + seq(50, 2)).node
    return parent, child


def test_a_host_copy_recorded_at_the_wrong_node_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = TreeHost.mark

    def on_the_parent(self: TreeHost, node: TreeNode, host_pages: Sequence[int], page_size: int) -> None:
        target = node.parent if node.parent is not None and node.parent.parent is not None else node
        real(self, target, host_pages, page_size)

    monkeypatch.setattr(TreeHost, "mark", on_the_parent)
    t = Tiered()
    _, child = two_level(t)
    t.copy(child)  # same page count as the parent: every count agrees
    t.tree.check_integrity()
    t.tree.evict(4)  # child removed, parent demoted to its (wrong) copy
    with pytest.raises(AssertionError, match="host page holds other tokens"):
        t.served(seq(0, 4))


def test_host_pages_shifted_by_one_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = TreeHost.mark

    def shifted(self: TreeHost, node: TreeNode, host_pages: Sequence[int], page_size: int) -> None:
        real(self, node, [*host_pages[1:], *host_pages[:1]], page_size)

    monkeypatch.setattr(TreeHost, "mark", shifted)
    t = Tiered()
    node = t.put(seq(0, 3)).node
    t.copy(node)
    t.tree.evict(1)
    with pytest.raises(AssertionError, match="host page holds other tokens"):
        t.served(seq(0, 3))


def test_a_split_that_shifts_host_pages_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = RadixTree._split

    def off_by_one(self: RadixTree, child: TreeNode, k: int) -> TreeNode:
        upper = real(self, child, k)
        if upper.host_pages is not None and child.host_pages:
            upper.host_pages.append(child.host_pages.pop(0))  # one host page on the wrong side
        return upper

    monkeypatch.setattr(RadixTree, "_split", off_by_one)
    t = Tiered()
    node = t.put(seq(0, 4)).node
    t.copy(node)
    t.tree.evict(1)
    t.tree.match(seq(0, 2), touch=False)  # splits the host-only node
    with pytest.raises(TreeIntegrityError, match="pages of 2"):
        t.tree.check_integrity()


def test_a_device_child_under_a_host_only_parent_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device eviction that ignores device-resident children would demote a parent first."""
    monkeypatch.setattr(
        TreeNode,
        "is_evictable_leaf",
        property(lambda n: n.parent is not None and n.lock_ref == 0 and bool(n.pages)),
    )
    t = Tiered()
    parent, child = two_level(t)
    t.copy(parent)
    t.copy(child)
    assert (parent.last_access, parent.id) < (child.last_access, child.id)
    t.tree.evict(1)  # LRU takes the parent first: its child is still on the device
    assert parent.tier == "host" and child.tier == "device+host"
    with pytest.raises(TreeIntegrityError, match="device-resident under host-only"):
        t.tree.check_integrity()


def test_host_counters_off_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TreeHost, "on_lock", lambda self, node: None)  # forgets to count locked copies
    t = Tiered()
    node = t.put(seq(0, 2)).node
    t.copy(node)  # the copy lands while locked, the unlock counts it: still consistent
    t.tree.check_integrity()
    t.tree.lock(node)  # a lock that forgets the host copy
    with pytest.raises(TreeIntegrityError, match="host counters"):
        t.tree.check_integrity()


def test_a_device_children_count_off_is_caught() -> None:
    t = Tiered()
    parent, _ = two_level(t)
    parent.device_children -= 1
    with pytest.raises(TreeIntegrityError, match="device children"):
        t.tree.check_integrity()


def test_a_host_candidate_missing_from_the_host_heap_is_caught() -> None:
    t = Tiered()
    node = t.put(seq(0, 2)).node
    t.copy(node)
    node.host_heap_version += 1  # its entry goes stale: the copy would never be evicted
    with pytest.raises(TreeIntegrityError, match="host heap"):
        t.tree.check_integrity()


def test_a_node_with_neither_pages_nor_a_copy_is_caught() -> None:
    t = Tiered()
    node = t.put(seq(0, 2)).node
    t.copy(node)
    t.tree.evict(1)
    node.host_pages = None
    with pytest.raises(TreeIntegrityError, match="0 pages"):
        t.tree.check_integrity()
