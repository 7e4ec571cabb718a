"""The radix tree's eviction candidates: a heap with lazy invalidation.

Entries are never updated in place. Each push bumps the node's `heap_version`; an entry
counts only if its version is the node's current one and the node is still an evictable
leaf (attached, unlocked, device-resident, no device-resident child: on a tree without
a host tier, a childless unlocked node). So re-keying a touched node, locking it or giving
it a child costs one push or nothing, and `pop` skips what went stale.

Stale entries are swept incrementally: every push also inspects the next few array
slots round-robin and removes the stale ones (O(log n) each). That bounds the heap to
about twice the live entries with no O(n) pause, which a one-shot compaction of a 100k
entry heap would be (tens of ms on the event loop).

NOTE: the tree must `push` a node whenever it becomes an evictable leaf or is touched
while it is one; a candidate without a current entry would never be evicted. The tree's
integrity check verifies this with `live_ids`.

`StateEvictHeap` is the same heap over a second version counter and another candidate
test (an unlocked attached node holding a state slot, leaf or not): hybrid trees evict
state slots in their own order (cache/radix_states.py). `HostEvictHeap` does the same
for host copies (cache/radix_host.py): unlocked nodes with a host copy that are either
device-resident too or leaves.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from cache.evict_policy import EvictPolicy
from cache.radix_node import TreeNode

# Entries compare by key, then node id, then version (a node can have stale twins with
# the same key): never by the node itself.
HeapEntry = tuple[tuple[float, ...], int, int, TreeNode]
SWEEP_PER_PUSH = 2


class EvictHeap:
    """Candidates are evictable leaves; versions live in `TreeNode.heap_version`."""

    def __init__(self, policy: EvictPolicy) -> None:
        self.policy = policy
        self._heap: list[HeapEntry] = []
        self._cursor = 0  # next array slot the sweep inspects

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        """(Re-)key `node` with the policy; any older entry of it goes stale."""
        version = self._bump(node)
        heapq.heappush(self._heap, (self.policy.key(node), node.id, version, node))
        self._sweep(SWEEP_PER_PUSH)

    def pop(self) -> TreeNode | None:
        """The evictable leaf with the smallest key, or None when there is none."""
        while self._heap:
            _, _, version, node = heapq.heappop(self._heap)
            if version == self._version(node) and self.is_candidate(node):
                return node  # its other entries, if any, are stale by version
        return None

    def peek(self, num_pages: int) -> list[TreeNode]:
        """The candidates `pop` would return first, in that order, until they hold at
        least `num_pages` device pages. They are pushed back with the same keys: the next
        `pop`s return the same nodes. O(k log n)."""
        taken: list[TreeNode] = []
        held = 0
        while held < num_pages:
            node = self.pop()
            if node is None:
                break
            taken.append(node)
            held += len(node.pages)
        for node in taken:
            self.push(node)
        return taken

    def rebuild(self, policy: EvictPolicy, nodes: Iterable[TreeNode]) -> None:
        """Switch policy and re-key every candidate among `nodes`: O(n)."""
        self.policy = policy
        self._heap = []
        self._cursor = 0
        for node in nodes:
            if self.is_candidate(node):
                self._heap.append((policy.key(node), node.id, self._bump(node), node))
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap = []

    def live_ids(self) -> set[int]:
        """Ids of nodes with a current entry (for the integrity check)."""
        return {node.id for _, _, version, node in self._heap if version == self._version(node)}

    def is_candidate(self, node: TreeNode) -> bool:
        """Whether `node` may be popped now (checked lazily, at pop and sweep time)."""
        return node.is_evictable_leaf

    def _version(self, node: TreeNode) -> int:
        return node.heap_version

    def _bump(self, node: TreeNode) -> int:
        node.heap_version += 1
        return node.heap_version

    def _sweep(self, steps: int) -> None:
        """Inspect `steps` slots from the cursor, removing stale entries.

        Each push adds at most one stale entry and the cursor passes every slot once per
        len/steps pushes, so stale entries stay below about len/steps.
        """
        heap = self._heap
        for _ in range(steps):
            if not heap:
                return
            i = self._cursor % len(heap)
            _, _, version, node = heap[i]
            if version == self._version(node) and self.is_candidate(node):
                self._cursor = i + 1
            else:
                self._remove_at(i)  # the cursor stays: the entry moved into slot i is next

    def _remove_at(self, i: int) -> None:
        """Delete slot `i`: move the last entry into it and restore heap order around it."""
        heap = self._heap
        entry = heap.pop()
        if i == len(heap):
            return
        while i > 0 and entry < heap[(i - 1) >> 1]:  # up, if smaller than its new parent
            heap[i] = heap[(i - 1) >> 1]
            i = (i - 1) >> 1
        while (child := 2 * i + 1) < len(heap):  # else down (a no-op after moving up)
            if child + 1 < len(heap) and heap[child + 1] < heap[child]:
                child += 1
            if not heap[child] < entry:
                break
            heap[i] = heap[child]
            i = child
        heap[i] = entry


class StateEvictHeap(EvictHeap):
    """Candidates are attached, unlocked nodes holding a state slot (leaves or not);
    versions live in `TreeNode.state_heap_version`, so the two heaps never stale each
    other's entries."""

    def is_candidate(self, node: TreeNode) -> bool:
        return node.parent is not None and node.state_slot is not None and node.lock_ref == 0

    def _version(self, node: TreeNode) -> int:
        return node.state_heap_version

    def _bump(self, node: TreeNode) -> int:
        node.state_heap_version += 1
        return node.state_heap_version


class HostEvictHeap(EvictHeap):
    """Candidates are `TreeNode.is_host_candidate` nodes (attached, unlocked, holding a
    host copy, device-resident or a leaf); versions live in `TreeNode.host_heap_version`."""

    def is_candidate(self, node: TreeNode) -> bool:
        return node.is_host_candidate

    def _version(self, node: TreeNode) -> int:
        return node.host_heap_version

    def _bump(self, node: TreeNode) -> int:
        node.host_heap_version += 1
        return node.host_heap_version
