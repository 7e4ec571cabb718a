"""The shape of the radix tree: walking a key down the tree, splitting a node, adding a
leaf, detaching a node. The counters and heaps these touch belong to `RadixTree`
(cache/radix_tree.py), which declares them; this mixin keeps only the mechanics.
"""

from __future__ import annotations

import itertools

from cache.evict_heap import EvictHeap
from cache.kv_events import BlockStored, EventHub, chain_hashes, namespace_seed
from cache.radix_host import TreeHost
from cache.radix_node import ChildKey, PageKey, TreeNode

# What the upper half of a split inherits. NOTE: invariant 2: state_slot / state_len stay
# with the lower half, which keeps the end position they cover; the upper is a tombstone.
# Residency is split, not copied: each half keeps its share of `pages` and `host_pages`.
_SPLIT_COPIES = ("lock_ref", "last_access", "last_access_wall", "hit_count", "created", "priority", "stored")


class TreeShape:
    """Walk, split, add and detach nodes (mixed into `RadixTree`)."""

    page_size: int
    root: TreeNode
    _ids: itertools.count[int]
    _heap: EvictHeap
    _events: EventHub
    _host: TreeHost | None
    _clock: int
    _wall: float
    _total: int
    _evictable: int
    _num_nodes: int

    def _child_key(self, parent: TreeNode, toks: PageKey, pos: int, namespace: str | None) -> ChildKey:
        page = toks[pos : pos + self.page_size]
        return (namespace, page) if parent is self.root else page

    def _walk(self, toks: PageKey, namespace: str | None) -> list[TreeNode]:
        """The nodes along `toks` as far as whole pages match, root excluded, splitting
        the last one if needed so it ends inside `toks`. Changes no stats."""
        node, pos, path = self.root, 0, []
        while pos < len(toks):
            child = self._matching_child(node, toks, pos, namespace)
            if child is None:
                break
            path.append(child)
            pos += len(child.key)
            node = child
        return path

    def _matching_child(
        self, node: TreeNode, toks: PageKey, pos: int, namespace: str | None
    ) -> TreeNode | None:
        """The child sharing at least the page at `pos`, split so it ends inside `toks`."""
        child = node.children.get(self._child_key(node, toks, pos, namespace))
        if child is None:
            return None
        key, ps = child.key, self.page_size
        if toks[pos : pos + len(key)] == key:
            return child
        k = 1  # the first page matched: it is the dict key
        while k < len(key) // ps and key[k * ps : (k + 1) * ps] == toks[pos + k * ps : pos + (k + 1) * ps]:
            k += 1
        return self._split(child, k)

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut `child` after `k` pages; returns the new upper node.

        `child` keeps its identity as the lower part: a lock or state slot refers to its
        end position, which does not move. The upper node inherits locks and stats (every
        lock on `child` also counted on it), so counters and the heap stay valid. NOTE:
        both halves keep `child`'s residency: device pages and host copy split alike.
        """
        parent, ps = child.parent, self.page_size
        assert parent is not None
        upper = TreeNode(
            next(self._ids), child.key[: k * ps], child.pages[:k], child.hashes[:k], parent, child.namespace
        )
        for stat in _SPLIT_COPIES:
            setattr(upper, stat, getattr(child, stat))
        child.key, child.pages, child.hashes = child.key[k * ps :], child.pages[k:], child.hashes[k:]
        if child.host_pages is not None:
            upper.host_pages, child.host_pages = child.host_pages[:k], child.host_pages[k:]
        upper.device_children = 1 if child.pages else 0
        parent.children[self._child_key(parent, upper.key, 0, upper.namespace)] = upper
        upper.children[child.key[:ps]] = child
        child.parent = upper
        self._num_nodes += 1
        if self._host is not None:
            self._host.on_candidate(upper)  # a device+host upper is a host candidate
        return upper

    def _add_leaf(
        self, parent: TreeNode, toks: PageKey, pages: list[int], namespace: str | None, priority: int
    ) -> TreeNode:
        leaf = self._new_leaf(parent, toks, pages, namespace, priority)
        parent.device_children += 1
        self._total += len(pages)
        self._evictable += len(pages)
        self._heap.push(leaf)
        parent_hash = parent.hash
        self._events.emit(lambda: [BlockStored(list(leaf.hashes), parent_hash, list(toks), self.page_size)])
        return leaf

    def _new_leaf(
        self, parent: TreeNode, toks: PageKey, pages: list[int], namespace: str | None, priority: int
    ) -> TreeNode:
        """A new child of `parent` holding `toks` (no accounting, no events)."""
        parent_hash = parent.hash
        seed = parent_hash if parent_hash is not None else namespace_seed(namespace)
        leaf = TreeNode(
            next(self._ids), toks, pages, chain_hashes(seed, toks, self.page_size), parent, namespace
        )
        leaf.created = leaf.last_access = self._clock
        leaf.last_access_wall = self._wall
        leaf.priority = priority
        parent.children[self._child_key(parent, toks, 0, namespace)] = leaf
        self._num_nodes += 1
        return leaf

    def _detach(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        assert parent is not None and node.lock_ref == 0
        del parent.children[self._child_key(parent, node.key, 0, node.namespace)]
        parent.device_children -= 1 if node.pages else 0
        node.parent = None
        self._total -= len(node.pages)
        self._evictable -= len(node.pages)
        self._num_nodes -= 1
        return parent

