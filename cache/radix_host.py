"""Host copies of a tiered radix tree: who owns them, what counts them, what evicts them.

A tiered tree (`free_host_pages` given) lets a cached prefix keep a copy of its KV in
host memory (ids into the host pool, cache/host_pool.py; id 0 is reserved), so that it
stays matchable after its device pages are evicted. The engine copies pages, never the
tree: it tells the tree when a copy has landed (`mark_host`) and when a host part was
loaded back into device pages (`restore`).

Residency of a node: "device" (`pages` only), "device+host" (`pages` and `host_pages`,
one host page per device page) or "host" (`pages == []`, `host_pages` only).

NOTE: the top-subtree invariant. Device-resident nodes form a top subtree: every
ancestor of a device-resident node is device-resident. It holds because device
eviction only takes nodes none of whose children are device-resident
(`TreeNode.device_children == 0`), and `restore` / `insert` give device pages back to a
whole path down from the deepest device-resident ancestor. So a match is a device part
followed by a host part, and a host-only node has only host-only descendants.

NOTE: host ownership, like page ownership (invariant 3). Every allocated host page has
exactly one owner: the tree (it sits on a node as `host_pages`) or the caller that
allocated it (a copy in flight). `mark_host` takes the caller's host pages; `match`
lends them (`MatchResult.host_pages`); only `evict_host`, `evict` (a device-only node
removed with host-only descendants) and `reset` give them back, through the tree's
`free_host_pages` callback.

NOTE: invariant 4 for host copies. The one lock count protects device pages, host copies
and state slots along the path alike: a locked node keeps all three, so a request loading
a host part back locks `MatchResult.host_node` and the copies it reads stay valid. Unlocked
copies are evicted from their own lazily invalidated heap (cache/evict_heap.py
`HostEvictHeap`) ordered by the tree's policy key: O(k log n) for k nodes, never a scan.
A host candidate is device-resident too (it only loses its copy) or a leaf (a host-only
leaf leaves the tree); a host-only internal node becomes one when its last child goes.

State slots (hybrid tiered trees) live in the state pool, not in device pages, so a
host-only node keeps its slot; the slot goes with the node (or by `evict_states`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cache.evict_heap import EvictHeap
from cache.kv_events import BlockRemoved, BlockStored, EventHub, KVEvent
from cache.radix_host_copies import FreeHostPages, TreeHost
from cache.radix_node import TreeNode
from cache.radix_states import TreeStates

__all__ = ["FreeHostPages", "HostTierMixin", "TreeHost", "removed_events"]

class HostTierMixin:
    """The tiered operations of `RadixTree` (cache/radix_tree.py), kept here with the rest
    of the host logic. They read and update the tree's own bookkeeping, declared below;
    the host-side bookkeeping is the tree's `TreeHost` (`_host`, None without a tier)."""

    page_size: int
    root: TreeNode
    _host: TreeHost | None
    _states: TreeStates | None
    _events: EventHub
    _heap: EvictHeap
    _total: int
    _evictable: int
    _protected: int
    _num_nodes: int

    if TYPE_CHECKING:

        def _detach(self, node: TreeNode) -> TreeNode: ...
        def _tick(self) -> None: ...
        def _walk(self, toks: tuple[int, ...], namespace: str | None) -> list[TreeNode]: ...
        def _new_leaf(
            self, parent: TreeNode, toks: tuple[int, ...], pages: list[int], namespace: str | None, priority: int
        ) -> TreeNode: ...

    @property
    def tiered(self) -> bool:
        """Whether the tree keeps host copies (`mark_host`, `evict_host`, `restore`)."""
        return self._host is not None

    @property
    def total_host_pages(self) -> int:
        """Host pages the tree owns (0 without a host tier)."""
        return self._host.total if self._host is not None else 0

    @property
    def evictable_host_pages(self) -> int:
        """Host pages on unlocked nodes: what repeated `evict_host` calls could free."""
        return self._host.evictable if self._host is not None else 0

    def evict_host(self, num_pages: int) -> list[int]:
        """Tiered trees: free host copies of unlocked nodes, smallest policy key first,
        until at least `num_pages` host pages went or none is left; returns them (they go
        to `free_host_pages`). A device+host node keeps its device pages (BlockRemoved
        medium "host"); a host-only leaf leaves the tree with its state slot (BlockRemoved
        medium None). May change: host pages and slots owned, nodes. [] without a tier.
        """
        if self._host is None:
            return []
        freed, dropped, removed = self._host.evict(num_pages, self._remove_host_leaf)
        if freed:
            events = self._states.release(removed) if self._states is not None else []
            self._events.emit(
                lambda: [*events, *removed_events(removed, None), *removed_events(dropped, "host")]
            )
        return freed

    def mark_host(self, node: TreeNode, host_pages: Sequence[int]) -> None:
        """Tiered trees: the engine finished copying `node.pages` to `host_pages` (same
        order) and verified the copy; the tree owns them from now on.

        The caller holds a lock on `node` from the start of the copy until this call, so
        `evict` cannot take the pages being read. A lock does not stop a split: if a match
        split `node` meanwhile, its page count changed and this raises, and the caller
        frees its host pages. Raises ValueError (changing nothing) on a tree without a
        host tier, if `node` already has a host copy, is not device-resident or not in
        the tree, or the counts differ. May change: host pages owned; emits BlockStored
        (medium "host").
        """
        self._require_host().mark(node, host_pages, self.page_size)

    def insert_host(
        self, tokens: Sequence[int], host_pages: Sequence[int], namespace: str | None = None,
        state_slot: int | None = None,
    ) -> tuple[TreeNode | None, list[int]]:
        """Tiered trees: cache `tokens` (whole pages) whose last `len(host_pages)` pages
        the engine filled host pages with itself (a storage fetch), in order.

        The pages before those must be in the tree already (on any tier: the fetch
        started where a match ended); if they no longer are, nothing is taken. Of the
        rest, pages the tree already holds keep the tree's copy; the remaining ones become
        one new host-only leaf, marked `stored`, below the deepest node matched (host-only
        under anything keeps the top-subtree invariant). Returns (that leaf or None, the
        caller's host pages not taken, for the caller to free). Hybrid trees need
        `state_slot`, the state after all of `tokens` (a host-only leaf a request cannot
        resume at is useless): the new leaf takes it; without a new leaf the caller keeps
        it. Raises ValueError, changing nothing, unless `tokens` are whole pages and
        `host_pages` distinct nonzero ids, at most one per page, and `state_slot` is given
        exactly on hybrid trees. May change: nodes, host pages and state slots owned; emits
        BlockStored (medium "host") and StateStored.
        """
        host, ps = self._require_host(), self.page_size
        if (self._states is None) != (state_slot is None):
            raise ValueError("insert_host takes a state slot on a hybrid tree, and only there")
        if self._states is not None and state_slot is not None:
            self._states.check_slot(state_slot, len(tokens))
        total = len(tokens) // ps
        if len(tokens) % ps or len(host_pages) > total:
            raise ValueError(f"{len(tokens)} tokens and {len(host_pages)} host pages are not whole pages")
        if 0 in host_pages or len(set(host_pages)) != len(host_pages):
            raise ValueError(f"host pages {list(host_pages)}: id 0 is reserved, ids must be distinct")
        self._tick()
        toks = tuple(tokens)
        path = self._walk(toks, namespace)
        have, first = sum(len(node.key) for node in path) // ps, total - len(host_pages)
        if have < first or have == total:
            return None, list(host_pages)  # a gap before the caller's pages, or nothing new
        parent = path[-1] if path else self.root
        leaf = self._new_leaf(parent, toks[have * ps :], [], namespace, 0)
        leaf.stored = True
        host.mark_new(leaf, host_pages[have - first :])
        if self._states is not None and state_slot is not None:
            self._states.attach(leaf, state_slot, len(toks))
        hashes, keys, parent_hash = list(leaf.hashes), list(leaf.key), parent.hash
        self._events.emit(lambda: [BlockStored(hashes, parent_hash, keys, ps, medium="host")])
        return leaf, list(host_pages[: have - first])

    def restore(self, host_node: TreeNode, device_pages: Sequence[int]) -> None:
        """Tiered trees: the engine loaded the host part ending at `host_node` back into
        `device_pages`, one per page along the path from just below the deepest
        device-resident ancestor down to `host_node`, in order; the tree owns them now and
        those nodes become device+host (BlockStored, medium None).

        Raises ValueError (changing nothing: the caller still owns `device_pages`) on a
        count mismatch, a reserved page 0, or if `host_node` is no longer host-resident
        (an `insert` of the same tokens took the caller's pages meanwhile). A split of the
        path meanwhile is harmless. The caller keeps `host_node` locked from `match` until
        after this call. May change: device pages owned, counters, heaps.
        """
        host = self._require_host()
        path = host.host_path(host_node)
        need = sum(len(node.key) for node in path) // self.page_size
        if len(device_pages) != need:
            raise ValueError(f"{len(device_pages)} device pages for a host part of {need} pages")
        if 0 in device_pages:
            raise ValueError("page 0 is reserved and never cached")
        self._adopt(path, list(device_pages))

    def _usable_parts(self, path: list[TreeNode]) -> tuple[list[TreeNode], list[TreeNode]]:
        """`match`: split a walked `path` into its device part and host part (NOTE: the
        top-subtree invariant makes them a prefix and the rest), hybrid: each trimmed to
        its deepest node holding a state slot, and no host part if the device part was
        trimmed (its tokens would not follow `length`)."""
        device = [node for node in path if node.pages]
        host_path = path[len(device) :]
        if self._states is not None:
            resumable = _resumable(device)
            host_path = _resumable(host_path) if len(resumable) == len(device) else []
            device = resumable
        return device, host_path

    def _adopt_host_suffix(self, path: list[TreeNode], pages: Sequence[int], start: int) -> list[int]:
        """`insert`: the host-only nodes ending `path` take the caller's `pages` from index
        `start` on for their tokens (the caller computed that KV); returns those pages."""
        host_path = [node for node in path if not node.pages]  # NOTE: a suffix (top subtree)
        if not host_path:
            return []
        taken = list(pages[start : start + sum(len(node.key) for node in host_path) // self.page_size])
        self._adopt(host_path, taken)
        return taken

    def _evict_node(
        self, node: TreeNode, gone: list[TreeNode], demoted: list[TreeNode], host_freed: list[int]
    ) -> TreeNode:
        """`evict` popped `node`: with a host copy it becomes host-only (into `demoted`),
        else it leaves the tree with its host-only descendants (into `gone`, their host
        pages into `host_freed`). Returns the parent. Frees nothing itself."""
        if node.host_pages is not None:
            demoted.append(node)
            return self._demote(node)
        parent = self._detach(node)
        gone.append(node)
        if self._host is not None and node.children:
            below, pages = self._host.drop_below(node)
            self._num_nodes -= len(below)
            gone += below
            host_freed += pages
        return parent

    def _adopt(self, path: list[TreeNode], pages: list[int]) -> None:
        """Give the host-only `path` (top-down, starting below a device-resident node or
        the root) device `pages`, one per page in order; they become device+host.

        NOTE: the top-subtree invariant holds because the whole path, from just below the
        deepest device-resident ancestor, becomes device-resident at once.
        """
        ps, start = self.page_size, 0
        for node in path:
            n = len(node.key) // ps
            node.pages, start = pages[start : start + n], start + n
            self._total += n
            if node.lock_ref:
                self._protected += n
            else:
                self._evictable += n
            assert node.parent is not None
            node.parent.device_children += 1
            if self._host is not None:
                self._host.on_candidate(node)
        if path[-1].is_evictable_leaf:
            self._heap.push(path[-1])  # the others have a device-resident child now
        parent = path[0].parent
        assert parent is not None
        parent_hash, hashes = parent.hash, [h for node in path for h in node.hashes]
        tokens = [t for node in path for t in node.key]
        self._events.emit(lambda: [BlockStored(hashes, parent_hash, tokens, ps)])

    def _demote(self, node: TreeNode) -> TreeNode:
        """Drop the device pages of `node` (unlocked, with a host copy and no
        device-resident child): it becomes host-only. Returns its parent."""
        parent = node.parent
        assert parent is not None and node.lock_ref == 0 and node.host_pages is not None
        self._total -= len(node.pages)
        self._evictable -= len(node.pages)
        node.pages = []
        parent.device_children -= 1
        return parent

    def _remove_host_leaf(self, node: TreeNode) -> None:
        """`evict_host` took the host copy of host-only leaf `node`: take it out."""
        parent = self._detach(node)
        if self._host is not None and not parent.children:
            self._host.on_candidate(parent)  # a host-only parent may be a leaf now

    def _require_host(self) -> TreeHost:
        if self._host is None:
            raise ValueError("a tree without a host tier (no free_host_pages) keeps no host copies")
        return self._host


def removed_events(nodes: list[TreeNode], medium: str | None) -> list[KVEvent]:
    """One BlockRemoved for the pages of `nodes` (none if there are none). `medium`
    names the copy that went; None: the pages left the cache entirely."""
    hashes = [h for node in nodes for h in node.hashes]
    return [BlockRemoved(block_hashes=hashes, medium=medium)] if hashes else []


def _resumable(path: list[TreeNode]) -> list[TreeNode]:
    """`path` trimmed back to its deepest node holding a state slot (hybrid trees)."""
    end = len(path)
    while end and path[end - 1].state_slot is None:
        end -= 1  # a tombstone: its KV is cached, its state is not
    return path[:end]
