"""State slots of a hybrid radix tree: who owns them, what counts them, what evicts them.

A hybrid model keeps a fixed-size recurrent state per request (a *state slot*, an id
into cache/state_pool.py; slot 0 is reserved and never cached). A cached prefix is only
resumable where a slot for exactly its end position exists, so the tree attaches at
most one slot to a node, for the node's end (`TreeNode.state_slot` / `state_len`).

NOTE: state ownership, like page ownership (invariant 3). Every allocated state slot
has exactly one owner: the tree (it sits on a node) or the caller that allocated it.
`match` lends a slot (the caller copies from it, never writes it), `insert` takes the
caller's slot unless the node already has one (`InsertResult.duplicate_state`: the
caller still owns it), and only `evict` (a leaf goes, and its slot with it),
`evict_states` and `reset` give slots back, through the tree's `free_states` callback.

NOTE: invariant 4 for states. One lock count serves KV and state: a node with
`lock_ref > 0` keeps its slot, and since a lock counts along the whole path, every
slot on a locked request's prefix is kept too. Unlocked slots are evicted from their
own lazily invalidated heap (cache/evict_heap.py `StateEvictHeap`), ordered by the
tree's policy key: O(k log n) for k slots, never a scan. Evicting an internal node's
slot leaves a tombstone (its KV stays for the nodes below).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from cache.evict_heap import StateEvictHeap
from cache.evict_policy import EvictPolicy
from cache.kv_events import EventHub, KVEvent, StateRemoved, StateStored
from cache.radix_check import StateBook
from cache.radix_node import TreeNode

FreeStates = Callable[[list[int]], None]


class TreeStates:
    """The state half of a hybrid tree. The tree calls the `on_*` hooks at every change
    of a node's lock count or stats; this class never walks or reshapes the tree."""

    def __init__(self, free_states: FreeStates, policy: EvictPolicy, events: EventHub) -> None:
        self._free_states = free_states
        self._events = events
        self.heap = StateEvictHeap(policy)
        self.total = 0  # slots the tree owns
        self.evictable = 0  # of which on unlocked nodes

    @staticmethod
    def check_slot(slot: int, num_tokens: int) -> None:
        """Raise ValueError unless `slot` may be inserted for a prefix of `num_tokens`."""
        if slot < 1:
            raise ValueError(f"state slot {slot} is reserved or invalid; slot 0 is never cached")
        if num_tokens == 0:
            raise ValueError("a state slot needs at least one page: the root is always a fresh state")

    def attach(self, node: TreeNode, slot: int, length: int) -> bool:
        """Give `slot` (the state after `length` tokens) to `node`, the attached node that
        ends at `length`. False when `node` already has a slot: the caller keeps `slot`.

        May change: `node.state_slot` / `state_len`, the counters, the state heap; emits
        StateStored when taken.
        """
        if node.state_slot is not None:
            return False
        # NOTE: invariant 2. The slot is recorded with the length it covers, which the
        # integrity check compares with the node's key length from the root.
        node.state_slot, node.state_len = slot, length
        self.total += 1
        if node.lock_ref == 0:
            self.evictable += 1
            self.heap.push(node)
        block_hash = node.hashes[-1]
        self._events.emit(lambda: [StateStored(block_hash, length)])
        return True

    def take(self, node: TreeNode, slot: int, length: int) -> int | None:
        """`insert`'s slot rule: attach `slot` to `node` if it has none; returns the
        caller's duplicate (None if taken, or if `slot` already is the node's own)."""
        if self.attach(node, slot, length) or node.state_slot == slot:
            return None
        return slot

    def detach(self, node: TreeNode) -> int | None:
        """Take `node`'s slot off it (the node must be unlocked); returns the slot, None
        if it had none. The caller frees it. May change: the node, the counters."""
        slot = node.state_slot
        if slot is None:
            return None
        assert node.lock_ref == 0, f"a state slot of locked {node!r} is never evicted"
        node.state_slot = node.state_len = None
        self.total -= 1
        self.evictable -= 1
        return slot

    def on_lock(self, node: TreeNode) -> None:
        """`node.lock_ref` went 0 -> 1."""
        if node.state_slot is not None:
            self.evictable -= 1

    def on_unlock(self, node: TreeNode) -> None:
        """`node.lock_ref` went 1 -> 0: its slot is a candidate again."""
        if node.state_slot is not None:
            self.evictable += 1
            self.heap.push(node)

    def on_touch(self, node: TreeNode) -> None:
        """`node`'s stats changed: re-key its slot (the old heap entry goes stale)."""
        if self.heap.is_candidate(node):
            self.heap.push(node)

    def evict(self, num_slots: int) -> list[int]:
        """Free the slots of up to `num_slots` unlocked nodes, smallest policy key first,
        through `free_states`; returns them in eviction order. The nodes stay in the tree
        with their KV: each becomes a tombstone. Emits one StateRemoved per slot.
        """
        slots: list[int] = []
        hashes: list[int] = []
        while len(slots) < num_slots:
            node = self.heap.pop()
            if node is None:
                break
            slot = self.detach(node)
            assert slot is not None  # the heap only yields nodes holding a slot
            slots.append(slot)
            hashes.append(node.hashes[-1])
        self.free(slots)
        if slots:
            self._events.emit(lambda: [StateRemoved(block_hash) for block_hash in hashes])
        return slots

    def release(self, evicted: list[TreeNode]) -> list[KVEvent]:
        """`evict` took these (unlocked) leaves out of the tree: free their slots with
        them; returns the StateRemoved events, for the tree to publish before the
        BlockRemoved of the same pages."""
        events: list[KVEvent] = []
        slots: list[int] = []
        for node in evicted:
            slot = self.detach(node)
            if slot is not None:
                slots.append(slot)
                events.append(StateRemoved(node.hashes[-1]))
        self.free(slots)
        return events

    def book(self) -> StateBook:
        """The bookkeeping the integrity check compares with a recount."""
        return StateBook(self.total, self.evictable, self.heap.live_ids())

    def free(self, slots: list[int]) -> None:
        if slots:
            self._free_states(slots)

    def clear(self, nodes: Iterable[TreeNode]) -> list[int]:
        """`reset`: take every slot off `nodes` (all unlocked) and zero the counters;
        returns the slots for the caller to `free`."""
        slots = []
        for node in nodes:
            if node.state_slot is not None:
                slots.append(node.state_slot)
                node.state_slot = node.state_len = None
        self.heap.clear()
        self.total = self.evictable = 0
        return slots

    def set_policy(self, policy: EvictPolicy, nodes: Iterable[TreeNode]) -> None:
        self.heap.rebuild(policy, nodes)
