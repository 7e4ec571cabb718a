"""The radix tree's eviction candidates: a heap with lazy invalidation.

Entries are never removed in place. Each push bumps the node's `heap_version`; a popped
entry is used only if its version is the node's current one and the node is still an
evictable leaf (attached, childless, unlocked). So re-keying a touched node, locking it
or giving it a child costs nothing here, and `pop` is O(log n) amortized.

NOTE: the tree must `push` a node whenever it becomes an evictable leaf or is touched
while it is one; a candidate without a current entry would never be evicted. The tree's
integrity check verifies this with `live_ids`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from cache.evict_policy import EvictPolicy
from cache.radix_node import TreeNode

# (policy key, node id as the tie-break, version at push time, node)
HeapEntry = tuple[tuple[float, ...], int, int, TreeNode]


class EvictHeap:
    def __init__(self, policy: EvictPolicy) -> None:
        self.policy = policy
        self._heap: list[HeapEntry] = []
        self._compact_at = 64

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        """(Re-)key `node` with the policy; any older entry of it goes stale."""
        node.heap_version += 1
        heapq.heappush(self._heap, (self.policy.key(node), node.id, node.heap_version, node))
        if len(self._heap) > self._compact_at:
            self._compact()

    def pop(self) -> TreeNode | None:
        """The evictable leaf with the smallest key, or None when there is none."""
        while self._heap:
            _, _, version, node = heapq.heappop(self._heap)
            if version == node.heap_version and node.is_evictable_leaf:
                return node
        return None

    def rebuild(self, policy: EvictPolicy, nodes: Iterable[TreeNode]) -> None:
        """Switch policy and re-key every evictable leaf among `nodes`: O(n)."""
        self.policy = policy
        self._heap = []
        for node in nodes:
            if node.is_evictable_leaf:
                node.heap_version += 1
                self._heap.append((policy.key(node), node.id, node.heap_version, node))
        heapq.heapify(self._heap)
        self._compact_at = 2 * len(self._heap) + 64

    def clear(self) -> None:
        self._heap = []
        self._compact_at = 64

    def live_ids(self) -> set[int]:
        """Ids of nodes with a current entry (for the integrity check)."""
        return {node.id for _, _, version, node in self._heap if version == node.heap_version}

    def _compact(self) -> None:
        # Drop stale entries. The next compaction waits until the heap doubles, so the
        # O(heap) pass is amortized O(1) per push.
        self._heap = [e for e in self._heap if e[2] == e[3].heap_version and e[3].is_evictable_leaf]
        heapq.heapify(self._heap)
        self._compact_at = 2 * len(self._heap) + 64
