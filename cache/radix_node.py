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
    `state_heap_version` to its state eviction heap (cache/radix_states.py).

    NOTE: invariant 2. `state_slot` (hybrid trees only) holds the recurrent state after
    exactly `state_len` tokens, and `state_len` must equal the node's key length from
    the root: the slot belongs to the node's end position. A node without a slot is a
    tombstone: its KV is cached but a request cannot resume there.
    """

    __slots__ = (
        "children",
        "created",
        "hashes",
        "heap_version",
        "hit_count",
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
        "tier",
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
        self.tier = "device"
        self.state_slot: int | None = None  # hybrid models: state for exactly this end position
        self.state_len: int | None = None  # tokens the state covers: the key length from the root
        self.heap_version = 0
        self.state_heap_version = 0

    @property
    def hash(self) -> int | None:
        """Chained hash of the node's last page: it names the whole prefix up to here."""
        return self.hashes[-1] if self.hashes else None

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def is_evictable_leaf(self) -> bool:
        """Attached (the root and evicted nodes have no parent), childless and unlocked."""
        return self.parent is not None and not self.children and self.lock_ref == 0

    def describe(self) -> dict[str, Any]:
        """Plain fields for the admin inspector (no references to other nodes)."""
        return {
            "id": self.id,
            "parent": self.parent.id if self.parent is not None else None,
            "num_tokens": len(self.key),
            "num_pages": len(self.pages),
            "lock_ref": self.lock_ref,
            "hit_count": self.hit_count,
            "last_access": self.last_access,
            "priority": self.priority,
            "tier": self.tier,
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
    resume. `lost_tokens` are the matched KV tokens past it (tombstones)."""

    length: int  # cached tokens, a multiple of page_size
    node: TreeNode  # deepest matched (hybrid: resumable) node; the root if nothing matched
    pages: list[int]  # the tree's page ids covering `length` (lent, not owned)
    state_slot: int | None = None  # hybrid: the state after exactly `length` tokens (lent); None at the root
    lost_tokens: int = 0  # KV-matched tokens past `length` that no state slot covers

    @property
    def kv_length(self) -> int:
        """How far the KV alone matched (== `length` on a dense tree)."""
        return self.length + self.lost_tokens


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
