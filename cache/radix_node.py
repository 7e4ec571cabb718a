"""Radix tree node and the results of `match` / `insert`.

Apart from the tree (cache/radix_tree.py) so that eviction policies and the integrity
check can name the node type without importing the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

# Children are keyed by their first page's tokens; the root's children also by namespace,
# which is how namespaces partition the tree (two namespaces never share a node).
PageKey = tuple[int, ...]
ChildKey = PageKey | tuple[str | None, PageKey]


class TreeNode:
    """One edge of the radix tree: a run of whole pages and their stats.

    `last_access` is the tree's logical clock (deterministic); `last_access_wall` is
    time.monotonic() for people. `heap_version` belongs to the tree's eviction heap,
    `state_heap_version` to its state eviction heap (cache/radix_states.py),
    `host_heap_version` to its host eviction heap (cache/radix_host.py).

    NOTE: residency (tiered trees, cache/radix_host.py). `pages` are device pages and
    `host_pages` (None: no host copy) host pool ids, one per page of `key` each when
    present: `tier` is "device" (pages only), "device+host" or "host" (`pages == []`).
    Device-resident nodes form a top subtree: a device-resident node's parent is the
    root or device-resident, so a host-only node has only host-only descendants.
    `device_children` counts the children holding device pages (all children on a tree
    without a host tier).

    NOTE: invariant 2. `state_slot` (hybrid trees only) holds the recurrent state after
    exactly `state_len` tokens, and `state_len` must equal the node's key length from
    the root: the slot belongs to the node's end position. A node without a slot is a
    tombstone: its KV is cached but a request cannot resume there.
    """

    __slots__ = (
        "children",
        "created",
        "device_children",
        "hashes",
        "heap_version",
        "hit_count",
        "host_heap_version",
        "host_pages",
        "id",
        "key",
        "last_access",
        "last_access_wall",
        "lock_ref",
        "namespace",
        "pages",
        "parent",
        "priority",
        "state_heap_version",
        "state_len",
        "state_slot",
        "stored",
    )

    def __init__(
        self,
        node_id: int,
        key: PageKey,
        pages: list[int],
        hashes: list[int],
        parent: TreeNode | None,
        namespace: str | None,
    ) -> None:
        self.id = node_id
        self.key = key  # len(key) == len(pages) * page_size
        self.pages = pages  # one page id per page of key
        self.hashes = hashes  # chained page hash per page (cache/kv_events.py)
        self.parent = parent  # None for the root and for detached (evicted) nodes
        self.children: dict[ChildKey, TreeNode] = {}
        self.namespace = namespace
        self.lock_ref = 0
        self.last_access = 0
        self.last_access_wall = 0.0
        self.hit_count = 0
        self.created = 0
        self.priority = 0  # max priority of the requests that inserted or used it
        self.host_pages: list[int] | None = None  # tiered trees: a verified host copy of `pages`
        self.device_children = 0  # children with device pages (eviction candidates have none)
        self.state_slot: int | None = None  # hybrid models: state for exactly this end position
        self.state_len: int | None = None  # tokens the state covers: the key length from the root
        self.heap_version = 0
        self.state_heap_version = 0
        self.host_heap_version = 0
        # Tiered trees with a storage tier: every page of `key` is known to be in storage
        # (written by this engine, or fetched from it). A hint for people and for skipping
        # rewrites; storage may evict it or another server may add it meanwhile.
        self.stored = False

    @property
    def hash(self) -> int | None:
        """Chained hash of the node's last page: it names the whole prefix up to here."""
        return self.hashes[-1] if self.hashes else None

    @property
    def num_pages(self) -> int:
        """Device pages held (0 for a host-only node)."""
        return len(self.pages)

    @property
    def tier(self) -> str:
        """Where the node's KV lives: "device", "device+host" or "host" (the root, which
        holds nothing, is "device")."""
        if self.key and not self.pages:
            return "host"
        return "device" if self.host_pages is None else "device+host"

    @property
    def is_evictable_leaf(self) -> bool:
        """A device-eviction candidate: attached (the root and evicted nodes have no
        parent), unlocked, holding device pages, with no device-resident child. On a
        tree without a host tier that is an unlocked leaf."""
        return (
            self.parent is not None and self.lock_ref == 0 and bool(self.pages) and not self.device_children
        )

    @property
    def is_host_candidate(self) -> bool:
        """A host-eviction candidate: attached, unlocked, holding a host copy, and either
        device-resident too (it only loses the copy) or a leaf (it leaves the tree)."""
        return (
            self.parent is not None
            and self.lock_ref == 0
            and self.host_pages is not None
            and (bool(self.pages) or not self.children)
        )

    def describe(self) -> dict[str, Any]:
        """Plain fields for the admin inspector (no references to other nodes)."""
        return {
            "id": self.id,
            "parent": self.parent.id if self.parent is not None else None,
            "num_tokens": len(self.key),
            "num_pages": len(self.pages),
            "num_host_pages": len(self.host_pages) if self.host_pages is not None else 0,
            "lock_ref": self.lock_ref,
            "hit_count": self.hit_count,
            "last_access": self.last_access,
            "priority": self.priority,
            "tier": self.tier,
            "stored": self.stored,
            "namespace": self.namespace,
            "state_slot": self.state_slot,
            "state_len": self.state_len,
        }

    def __repr__(self) -> str:
        # Not the default repr: parent/children would print the whole tree.
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key)}, pages={self.pages}, "
            f"lock_ref={self.lock_ref}, namespace={self.namespace!r})"
        )


class MatchResult(NamedTuple):
    """What a match lends. On a hybrid tree `length`/`node`/`pages` stop at the deepest
    matched node that holds a state slot (the root if none does): where a request can
    resume. `lost_tokens` are the matched KV tokens past what the result can use
    (tombstones).

    Tiered trees add the host part: `host_length` tokens right after `length`, cached on
    host only (whole pages, contiguous), their host ids `host_pages` in order, and
    `host_node`, the node ending at `length + host_length`: lock it while loading them
    back (then `restore`). Without a host part: 0, [], None."""

    length: int  # cached tokens, a multiple of page_size
    node: TreeNode  # deepest matched (hybrid: resumable) node; the root if nothing matched
    pages: list[int]  # the tree's page ids covering `length` (lent, not owned)
    state_slot: int | None = None  # hybrid: the state after exactly `length` tokens (lent); None at the root
    lost_tokens: int = 0  # KV-matched tokens past `length + host_length` that no state slot covers
    host_length: int = 0  # tokens after `length` on host only (tiered trees), a multiple of page_size
    host_pages: list[int] = []  # noqa: RUF012 (a NamedTuple default, never mutated) host ids of those tokens
    host_node: TreeNode | None = None  # deepest matched host-only node; lock it during a load-back

    @property
    def kv_length(self) -> int:
        """How far the KV matched over both tiers (== `length` on a dense tree without a
        host tier)."""
        return self.length + self.host_length + self.lost_tokens


class InsertResult(NamedTuple):
    prefix_len: int  # leading tokens the tree already had
    node: TreeNode  # node ending exactly at the inserted key: lock it while still in use
    pages: list[int]  # the tree's page ids for the whole key (point the request table here)
    # The caller's state slot the tree did not take (the node already had one): the
    # caller still owns and must free it. None when the tree took it or none was given.
    duplicate_state: int | None = None

    def duplicates(self, caller_pages: Sequence[int]) -> list[int]:
        """The caller's pages the tree did not take: the caller still owns and must free them."""
        return [mine for mine, tree in zip(caller_pages, self.pages) if mine != tree]
