"""The host-copy bookkeeping of a tiered radix tree (`TreeHost`): which host pages the
tree owns, how many are evictable, and the host eviction heap. The ownership rules and
the top-subtree invariant are in cache/radix_host.py's docstring; the tiered operations
that use this are `HostTierMixin` there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from cache.evict_heap import HostEvictHeap
from cache.evict_policy import EvictPolicy
from cache.kv_events import BlockStored, EventHub
from cache.radix_check import HostBook
from cache.radix_node import TreeNode

FreeHostPages = Callable[[list[int]], None]


class TreeHost:
    """The host half of a tiered tree. The tree calls the `on_*` hooks at every change
    of a node's lock count, stats or candidacy; this class reshapes nothing but
    `host_pages` and never walks the tree, except below a node the tree removes."""

    def __init__(self, free_host_pages: FreeHostPages, policy: EvictPolicy, events: EventHub) -> None:
        self._free_host_pages = free_host_pages
        self._events = events
        self.heap = HostEvictHeap(policy)
        self.total = 0  # host pages the tree owns
        self.evictable = 0  # of which on unlocked nodes

    def mark(self, node: TreeNode, host_pages: Sequence[int], page_size: int) -> None:
        """Record `host_pages` as the verified copy of `node.pages` (same order).

        Raises ValueError (changing nothing) unless `node` is attached, device-resident,
        has no host copy yet, and `host_pages` are as many nonzero distinct ids as its
        device pages. May change: `node.host_pages`, the counters, the host heap; emits
        BlockStored(medium="host").
        """
        if node.parent is None:
            raise ValueError(f"mark_host of {node!r}, which is not in the tree")
        if node.host_pages is not None:
            raise ValueError(f"{node!r} already has a host copy")
        if not node.pages:
            raise ValueError(f"{node!r} is not device-resident: there is nothing to copy")
        if len(host_pages) != len(node.pages):
            raise ValueError(
                f"{len(host_pages)} host pages for the {len(node.pages)} device pages of {node!r}"
            )
        if 0 in host_pages or len(set(host_pages)) != len(host_pages):
            raise ValueError(f"host pages {list(host_pages)}: id 0 is reserved, ids must be distinct")
        node.host_pages = list(host_pages)
        self.total += len(host_pages)
        if node.lock_ref == 0:
            self.evictable += len(host_pages)
        self.on_candidate(node)
        parent_hash = node.parent.hash
        hashes, tokens = list(node.hashes), list(node.key)
        self._events.emit(lambda: [BlockStored(hashes, parent_hash, tokens, page_size, medium="host")])

    def mark_new(self, leaf: TreeNode, host_pages: Sequence[int]) -> None:
        """A new host-only leaf (`insert_host`) owns `host_pages` from now on."""
        leaf.host_pages = list(host_pages)
        self.total += len(host_pages)
        self.evictable += len(host_pages)
        self.on_candidate(leaf)

    @staticmethod
    def host_path(node: TreeNode) -> list[TreeNode]:
        """The host-only nodes from just below the deepest device-resident ancestor down
        to `node`, in that order. Raises ValueError unless `node` is attached and
        host-only. Changes nothing."""
        if node.parent is None:
            raise ValueError(f"{node!r} is not in the tree (evicted or reset)")
        if node.pages:
            raise ValueError(f"{node!r} is no longer host-resident (restored or inserted meanwhile)")
        path: list[TreeNode] = []
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None and not walk.pages:
            path.append(walk)
            walk = walk.parent
        path.reverse()
        return path

    def take_off(self, node: TreeNode) -> list[int]:
        """Remove `node`'s host copy (the node must be unlocked); returns its host pages
        ([] if none) for the caller to `free`. May change: the node, the counters."""
        pages = node.host_pages
        if pages is None:
            return []
        assert node.lock_ref == 0, f"the host copy of locked {node!r} is never evicted"
        node.host_pages = None
        self.total -= len(pages)
        self.evictable -= len(pages)
        return pages

    def evict(
        self, num_pages: int, remove_leaf: Callable[[TreeNode], None]
    ) -> tuple[list[int], list[TreeNode], list[TreeNode]]:
        """Free host copies of unlocked candidates, smallest policy key first, until at
        least `num_pages` host pages went or none is left: a device+host node keeps its
        device pages, a host-only leaf is taken out of the tree by `remove_leaf` (which
        must push its parent here if that became a candidate). Frees the host pages
        through `free_host_pages`. Returns (freed host pages, nodes that kept their device
        pages, nodes removed). Emits nothing: the tree publishes the events.
        """
        freed: list[int] = []
        dropped: list[TreeNode] = []
        removed: list[TreeNode] = []
        while len(freed) < num_pages:
            node = self.heap.pop()
            if node is None:
                break
            freed.extend(self.take_off(node))
            if node.pages:
                dropped.append(node)
            else:
                remove_leaf(node)
                removed.append(node)
        self.free(freed)
        return freed, dropped, removed

    def drop_below(self, node: TreeNode) -> tuple[list[TreeNode], list[int]]:
        """`node` (unlocked, device-only) was taken out of the tree: take out its
        descendants too, which are all host-only (the top-subtree invariant). Returns them
        and their host pages, which the caller frees. Each gets `parent = None`, so a
        stale handle can no longer be locked. O(descendants)."""
        gone: list[TreeNode] = []
        pages: list[int] = []
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            assert not child.pages, f"device-resident {child!r} below an evicted node"
            pages.extend(self.take_off(child))
            child.parent = None
            gone.append(child)
            stack.extend(child.children.values())
        return gone, pages

    def on_lock(self, node: TreeNode) -> None:
        """`node.lock_ref` went 0 -> 1."""
        if node.host_pages is not None:
            self.evictable -= len(node.host_pages)

    def on_unlock(self, node: TreeNode) -> None:
        """`node.lock_ref` went 1 -> 0: its copy counts as evictable again."""
        if node.host_pages is not None:
            self.evictable += len(node.host_pages)
        self.on_candidate(node)

    def on_candidate(self, node: TreeNode) -> None:
        """`node`'s stats or candidacy may have changed: (re-)key it if it is a candidate
        (NOTE: a candidate without a current entry would never be evicted)."""
        if node.is_host_candidate:
            self.heap.push(node)

    def book(self) -> HostBook:
        """The bookkeeping the integrity check compares with a recount."""
        return HostBook(self.total, self.evictable, self.heap.live_ids())

    def free(self, pages: list[int]) -> None:
        if pages:
            self._free_host_pages(pages)

    def clear(self, nodes: Iterable[TreeNode]) -> list[int]:
        """`reset`: take every host copy off `nodes` (all unlocked) and zero the counters;
        returns the host pages for the caller to `free`."""
        pages: list[int] = []
        for node in nodes:
            if node.host_pages is not None:
                pages.extend(node.host_pages)
                node.host_pages = None
        self.heap.clear()
        self.total = self.evictable = 0
        return pages

    def set_policy(self, policy: EvictPolicy, nodes: Iterable[TreeNode]) -> None:
        self.heap.rebuild(policy, nodes)
