"""Hybrid radix tree: state slots per node, resumable matches, tombstones, state eviction,
state events and the state half of the integrity check (with planted bugs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from cache.allocator import PageAllocator
from cache.evict_heap import StateEvictHeap
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
from cache.prefix_cache import NoPrefixCache
from cache.radix_states import TreeStates
from cache.radix_tree import InsertResult, RadixTree, TreeIntegrityError, TreeNode
from handlers.evict_lru import LRU


class SlotPool:
    """A state-slot free list (slot 0 reserved) that refuses double frees."""

    def __init__(self, num_slots: int) -> None:
        self.num_usable = num_slots - 1
        self.free_list: list[int] = list(range(num_slots - 1, 0, -1))
        self.freed: list[int] = []  # every slot given back, in order

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self) -> int | None:
        return self.free_list.pop() if self.free_list else None

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            assert slot != 0, "slot 0 freed"
            assert slot not in self.free_list, f"slot {slot} freed twice"
            self.free_list.append(slot)
            self.freed.append(slot)


class Hybrid:
    """A hybrid tree wired to a page allocator and a slot pool, recording events."""

    def __init__(self, page_size: int = 2, policy: EvictPolicy | None = None, num_slots: int = 64) -> None:
        self.ps = page_size
        self.alloc = PageAllocator(256)
        self.slots = SlotPool(num_slots)
        self.tree = RadixTree(page_size, self.alloc.free, policy or LRU(), free_states=self.slots.free)
        self.events: list[KVEvent] = []
        self.tree.subscribe(self.events.extend)

    def put(
        self, tokens: Sequence[int], namespace: str | None = None, state: bool = True
    ) -> tuple[InsertResult, int | None]:
        """Insert like a request that computed everything: fresh pages and (optionally) a
        fresh slot; frees the duplicates. Returns the result and the slot offered."""
        pages = self.alloc.allocate(len(tokens) // self.ps)
        slot = self.slots.allocate() if state else None
        result = self.tree.insert(tokens, pages, namespace, state_slot=slot)
        self.alloc.free(result.duplicates(pages))
        if result.duplicate_state is not None:
            self.slots.free([result.duplicate_state])
        return result, slot

    def balanced(self, held_states: int = 0) -> bool:
        pages = self.alloc.num_free + self.tree.total_pages == self.alloc.num_usable
        states = self.slots.num_free + self.tree.total_states + held_states == self.slots.num_usable
        return pages and states

    def check(self, held_states: Sequence[int] = ()) -> None:
        self.tree.check_integrity(held_states=held_states)
        assert self.balanced(len(held_states))


def seq(start: int, num_pages: int, ps: int = 2) -> list[int]:
    return list(range(start, start + num_pages * ps))


def depth(node: TreeNode) -> int:
    total = 0
    while node.parent is not None:
        total += len(node.key)
        node = node.parent
    return total


# -- insert and match ------------------------------------------------------------------
@pytest.mark.parametrize("ps", [1, 2, 4])
def test_insert_with_state_at_several_depths(ps: int) -> None:
    h = Hybrid(ps)
    a = seq(0, 6, ps)
    full, s6 = h.put(a)
    assert full.node.state_slot == s6 and full.node.state_len == 6 * ps
    mid, s3 = h.put(a[: 3 * ps])  # ends inside the 6-page node: split, slot on the upper
    assert mid.prefix_len == 3 * ps and mid.duplicate_state is None
    assert mid.node.state_slot == s3 and mid.node.state_len == 3 * ps == depth(mid.node)
    assert full.node.state_slot == s6 and full.node.state_len == depth(full.node), "the split kept the end"
    one, s1 = h.put(a[:ps])
    assert one.node.state_slot == s1 and h.tree.total_states == 3 == h.tree.evictable_states

    for pages, (length, slot) in {6: (6, s6), 5: (3, s3), 3: (3, s3), 2: (1, s1), 1: (1, s1)}.items():
        hit = h.tree.match(a[: pages * ps] + [999] * ps)
        assert (hit.length, hit.state_slot, hit.kv_length) == (length * ps, slot, pages * ps)
        assert hit.pages == full.pages[:length] and hit.node.state_slot == slot
        assert hit.lost_tokens == (pages - length) * ps
    h.check()


def test_match_trims_to_the_deepest_stateful_node_at_an_off_grid_branch() -> None:
    h = Hybrid(2)
    a = seq(0, 4)
    h.put(a)  # state at 8 tokens only
    b = a[:6] + seq(100, 2)  # shares 3 pages: the branch point (6 tokens) has no state
    h.put(b)
    branch = h.tree.match(a[:6] + [555, 556])
    assert branch.kv_length == 6 and branch.length == 0 and branch.node is h.tree.root
    assert branch.state_slot is None and branch.pages == []
    h.put(a[:4])  # a state at 4 tokens makes the branch resumable from there
    branch = h.tree.match(a[:6] + [555, 556])
    assert (branch.length, branch.kv_length) == (4, 6) and branch.state_slot == branch.node.state_slot
    assert h.tree.match(b).length == 10
    h.check()


def test_match_touches_only_the_nodes_it_resumes_through() -> None:
    h = Hybrid(2)
    a = seq(0, 4)
    h.put(a[:4])
    h.put(a, state=False)  # a tombstone leaf past the stateful node
    tomb = h.tree.match(a, touch=False)
    assert tomb.kv_length == 8 and tomb.length == 4
    deep = next(n for n in h.tree.nodes() if n.state_slot is None)
    hits = deep.hit_count
    h.tree.match(a)
    assert deep.hit_count == hits and tomb.node.hit_count == 1


def test_namespaces_keep_their_states_apart() -> None:
    h = Hybrid(2)
    a = seq(0, 3)
    _, slot_a = h.put(a, namespace="a")
    h.put(a, namespace=None, state=False)
    assert h.tree.match(a, "a").state_slot == slot_a
    plain = h.tree.match(a)
    assert (plain.length, plain.kv_length, plain.state_slot) == (0, 6, None)
    h.check()


def test_duplicate_state_stays_with_the_caller() -> None:
    h = Hybrid(2)
    a = seq(0, 2)
    first, slot = h.put(a)
    pages = h.alloc.allocate(2)
    mine = h.slots.allocate()
    assert mine is not None and mine != slot
    again = h.tree.insert(a, pages, state_slot=mine)
    assert again.duplicate_state == mine and again.node.state_slot == slot
    assert h.tree.total_states == 1
    h.alloc.free(again.duplicates(pages))
    h.check(held_states=[mine])  # still the caller's
    h.slots.free([mine])
    own = h.tree.insert(a, first.pages, state_slot=slot)  # the node's own slot: nothing to free
    assert own.duplicate_state is None
    h.check()


def test_insert_rejects_bad_slots_and_dense_trees_reject_slots() -> None:
    h = Hybrid(2)
    with pytest.raises(ValueError, match="slot 0"):
        h.tree.insert(seq(0, 1), [5], state_slot=0)
    with pytest.raises(ValueError, match="root"):
        h.tree.insert([], [], state_slot=3)
    assert h.tree.total_pages == 0 and h.tree.num_nodes == 0, "a rejected insert changes nothing"
    alloc = PageAllocator(16)
    dense = RadixTree(2, alloc.free, LRU())
    assert not dense.hybrid and h.tree.hybrid
    with pytest.raises(ValueError, match="dense"):
        dense.insert(seq(0, 1), [5], state_slot=3)
    assert dense.total_pages == 0


def test_dense_match_has_no_state_and_full_kv_length() -> None:
    alloc = PageAllocator(16)
    dense = RadixTree(2, alloc.free, LRU())
    dense.insert(seq(0, 2), alloc.allocate(2))
    hit = dense.match(seq(0, 2))
    assert hit.length == hit.kv_length == 4 and hit.state_slot is None
    assert dense.evict_states(5) == [] and dense.total_states == dense.evictable_states == 0
    none = NoPrefixCache(2)
    miss = none.match(seq(0, 2))
    assert miss.kv_length == 0 and miss.state_slot is None and not none.hybrid
    assert none.evict_states(1) == [] and none.total_states == 0


# -- eviction ------------------------------------------------------------------------
def test_evict_states_leaves_tombstones_and_keeps_kv() -> None:
    h = Hybrid(2)
    a = seq(0, 4)
    _, shallow = h.put(a[:4])
    _, deep = h.put(a)
    h.tree.match(a)  # both touched at one clock: the tie goes to the lower id (shallow)
    pages = h.tree.total_pages
    assert h.tree.evict_states(1) == [shallow] == h.slots.freed
    assert h.tree.total_pages == pages and h.tree.total_states == 1
    hit = h.tree.match(a)  # an internal tombstone does not stop a deeper resume
    assert (hit.length, hit.state_slot) == (8, deep)
    assert h.tree.match(a[:6]).length == 0, "the tombstone is not resumable"
    assert h.tree.evict_states(1) == [deep]
    hit = h.tree.match(a)
    assert (hit.length, hit.kv_length, hit.state_slot) == (0, 8, None)
    assert h.tree.evict_states(1) == [] and h.tree.total_pages == pages
    assert isinstance(h.events[-1], StateRemoved)
    h.check()


def test_evict_states_follows_the_policy_order() -> None:
    h = Hybrid(2)
    slots = [h.put(seq(100 * i, 1 + i % 3))[1] for i in range(6)]
    h.tree.match(seq(0, 1))  # the first becomes the most recent
    assert h.tree.evict_states(6) == slots[1:] + slots[:1]
    h.check()


def test_locked_states_are_never_evicted() -> None:
    h = Hybrid(2)
    a = seq(0, 4)
    _, shallow = h.put(a[:4])
    deep_result, deep = h.put(a)
    _, other = h.put(seq(500, 2))
    h.tree.lock(deep_result.node)  # locks the shallow node's state too (the path)
    assert h.tree.evictable_states == 1 and h.tree.total_states == 3
    assert h.tree.evict_states(10) == [other]
    assert h.tree.evict(100) and h.tree.match(a).state_slot == deep, "locked KV stays too"
    h.tree.unlock(deep_result.node)
    assert h.tree.evictable_states == 2
    assert set(h.tree.evict_states(10)) == {shallow, deep}
    h.check()


def test_evict_of_a_leaf_frees_its_state_and_tombstone_leaves_evict_normally() -> None:
    h = Hybrid(2)
    a = seq(0, 2)
    result, slot = h.put(a)
    leaf_hash = result.node.hashes[-1]
    h.events.clear()
    assert h.tree.evict(1) == result.pages
    assert h.slots.freed == [slot] and h.tree.total_states == 0
    assert h.events == [StateRemoved(leaf_hash), BlockRemoved(block_hashes=list(result.node.hashes))]
    tomb, _ = h.put(seq(50, 2), state=False)
    h.events.clear()
    assert h.tree.evict(1) == tomb.pages and h.events == [BlockRemoved(block_hashes=tomb.node.hashes)]
    h.check()


def test_reset_frees_every_state() -> None:
    h = Hybrid(2)
    slots = {h.put(seq(0, i + 1))[1] for i in range(4)} | {h.put(seq(300, 2))[1]}
    h.tree.reset()
    assert set(h.slots.freed) == slots and h.tree.total_states == h.tree.evictable_states == 0
    assert h.events[-1] == AllBlocksCleared()
    h.check()


def test_set_policy_rebuilds_the_state_heap() -> None:
    h = Hybrid(2)
    for i in range(5):
        h.put(seq(10 * i, 1))
    h.tree.set_policy(LRU())
    h.check()
    assert len(h.tree.evict_states(5)) == 5


class CountingLRU(LRU):
    def __init__(self) -> None:
        self.calls = 0

    def key(self, node: TreeNode) -> tuple[float, ...]:
        self.calls += 1
        return super().key(node)


def evict_every_state(n: int) -> None:
    """`n` stateful nodes, every slot evicted: the policy computes no key on the way (a
    scan would compute one per node per eviction)."""
    policy = CountingLRU()
    alloc = PageAllocator(2 * n + 1)
    pool = SlotPool(n + 2)
    tree = RadixTree(1, alloc.free, policy, free_states=pool.free)
    for i in range(n):
        tree.insert([i, i], alloc.allocate(2), state_slot=pool.allocate())
    policy.calls = 0
    freed = tree.evict_states(10) + tree.evict_states(n - 10)
    assert len(freed) == n and tree.total_states == 0 and tree.total_pages == 2 * n
    assert policy.calls == 0, "evict_states re-keyed nodes: a scan, not a heap"


def test_evict_states_pops_a_heap_and_never_scans() -> None:
    """10k stateful nodes: evicting their slots computes no policy key. (Counted, not
    timed: a key computed is the cost a scan would add, whatever the machine.)"""
    evict_every_state(10_000)


def test_red_a_state_heap_that_scans_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: each pop looks for the smallest key among all candidates (a scan)."""
    real_pop = StateEvictHeap.pop

    def scanning_pop(self: StateEvictHeap) -> TreeNode | None:
        for *_, node in self._heap:
            if self.is_candidate(node):
                self.policy.key(node)
        return real_pop(self)

    monkeypatch.setattr(StateEvictHeap, "pop", scanning_pop)
    with pytest.raises(AssertionError, match="evict_states re-keyed nodes: a scan, not a heap"):
        evict_every_state(200)


# -- events and inspection ---------------------------------------------------------------
def test_state_events_name_the_prefix_by_its_last_page_hash() -> None:
    h = Hybrid(2)
    a = seq(0, 3)
    h.put(a, namespace="ns")
    stored = [e for e in h.events if isinstance(e, (BlockStored, StateStored))]
    hashes = page_hashes(a, 2, "ns")
    assert isinstance(stored[0], BlockStored) and stored[1] == StateStored(hashes[-1], 6)
    h.events.clear()
    h.put(a[:2], namespace="ns")  # split: a state on an existing page, no new blocks
    assert h.events == [StateStored(hashes[0], 2)]
    snap = {d["num_tokens"]: d for d in h.tree.snapshot()}
    assert snap[2]["state_slot"] is not None and snap[4]["state_slot"] is not None
    assert snap[0]["state_slot"] is None  # the root: num_tokens 0


# -- the integrity check, shown to fail ----------------------------------------------------
def planted() -> Hybrid:
    h = Hybrid(2)
    a = seq(0, 4)
    h.put(a[:4])
    h.put(a)
    h.put(a[:4] + seq(90, 1))
    h.check()
    return h


def stateful(h: Hybrid) -> list[TreeNode]:
    return [n for n in h.tree.nodes() if n.state_slot is not None]


def wrong_length(h: Hybrid) -> None:
    node = stateful(h)[0]
    assert node.state_len is not None
    node.state_len += 2  # a state "ahead" of its KV: the lesson from the field


def slot_twice(h: Hybrid) -> None:
    first, second = stateful(h)[:2]
    second.state_slot = first.state_slot


def slot_zero(h: Hybrid) -> None:
    stateful(h)[0].state_slot = 0


def length_without_slot(h: Hybrid) -> None:
    node = stateful(h)[0]
    node.state_slot = None


def state_miscount(h: Hybrid) -> None:
    assert h.tree._states is not None
    h.tree._states.evictable += 1


def lose_state_heap_entry(h: Hybrid) -> None:
    stateful(h)[0].state_heap_version += 1


def state_on_root(h: Hybrid) -> None:
    h.tree.root.state_slot = 7


STATE_PLANTS: dict[str, tuple[Callable[[Hybrid], None], str]] = {
    "wrong-length": (wrong_length, "covers"),
    "slot-twice": (slot_twice, "twice"),
    "slot-zero": (slot_zero, "slot 0"),
    "length-without-slot": (length_without_slot, "without a state slot"),
    "counter": (state_miscount, "state counters"),
    "missing-from-state-heap": (lose_state_heap_entry, "state heap"),
    "root-state": (state_on_root, "root"),
}


@pytest.mark.parametrize("name", list(STATE_PLANTS))
def test_planted_state_bugs_make_the_check_fail(name: str) -> None:
    plant, message = STATE_PLANTS[name]
    h = planted()
    plant(h)
    with pytest.raises(TreeIntegrityError, match=message):
        h.tree.check_integrity()


def test_a_slot_attached_at_the_wrong_node_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant the bug in the attach path itself: the slot lands on the parent of the node
    ending at its position (a state ahead of its KV)."""
    h = planted()
    real = TreeStates.attach

    def off_by_a_node(self: TreeStates, node: TreeNode, slot: int, length: int) -> bool:
        target = node.parent if node.parent is not None and node.parent.parent is not None else node
        return real(self, target, slot, length)

    monkeypatch.setattr(TreeStates, "attach", off_by_a_node)
    h.put(seq(200, 2), state=False)  # a tombstone ...
    h.put(seq(200, 2) + seq(70, 1))  # ... whose child's slot lands on it
    with pytest.raises(TreeIntegrityError, match="covers"):
        h.tree.check_integrity()


def test_a_held_slot_also_in_the_tree_fails_the_check() -> None:
    h = planted()
    tree_slot = stateful(h)[0].state_slot
    assert tree_slot is not None
    with pytest.raises(TreeIntegrityError, match="both"):
        h.tree.check_integrity(held_states=[tree_slot])
    with pytest.raises(TreeIntegrityError, match="twice"):
        h.tree.check_integrity(held_states=[63, 63])


def test_a_state_slot_in_a_dense_tree_fails_the_check() -> None:
    alloc = PageAllocator(16)
    dense = RadixTree(2, alloc.free, LRU())
    node = dense.insert(seq(0, 1), alloc.allocate(1)).node
    node.state_slot, node.state_len = 3, 2
    with pytest.raises(TreeIntegrityError, match="dense"):
        dense.check_integrity()
