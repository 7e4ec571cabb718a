"""Full consistency check of a radix tree (debug.check_invariants and tests). O(tree)."""

from __future__ import annotations

from collections.abc import Iterable

from cache.kv_events import chain_hashes, namespace_seed
from cache.radix_node import TreeNode


class TreeIntegrityError(AssertionError):
    """The tree broke one of its invariants; the message names the node and the rule."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TreeIntegrityError(message)


def check_tree(
    root: TreeNode,
    page_size: int,
    counters: tuple[int, int, int, int],
    heap_live: set[int],
    held_pages: Iterable[int] = (),
) -> None:
    """Check structure, page ownership, locks, hashes, counters and the eviction heap.

    counters: (total, evictable, protected, num_nodes) as the tree maintains them.
    heap_live: ids of nodes with a current (non-stale) heap entry.
    held_pages: pages owned by live requests; none may also be owned by the tree.
    """
    _require(root.parent is None and not root.key and not root.pages, "root must be empty and parentless")
    _require(root.lock_ref == 0, f"root lock_ref is {root.lock_ref}, roots are never counted")
    seen_pages: set[int] = set()
    total = evictable = protected = num_nodes = 0
    stack = [root]
    while stack:
        parent = stack.pop()
        for child_key, node in parent.children.items():
            _check_node(node, parent, root, child_key, page_size)
            _check_pages(node, seen_pages)
            num_nodes += 1
            total += len(node.pages)
            if node.lock_ref:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
            if not node.children and not node.lock_ref:
                _require(node.id in heap_live, f"{node!r} is an unlocked leaf missing from the eviction heap")
            stack.append(node)
    _check_held(held_pages, seen_pages)
    recount = (total, evictable, protected, num_nodes)
    _require(
        recount == counters, f"counters (total, evictable, protected, nodes) {counters} != recount {recount}"
    )


def _check_node(node: TreeNode, parent: TreeNode, root: TreeNode, child_key: object, page_size: int) -> None:
    _require(node.parent is parent, f"{node!r} does not point back to its parent {parent!r}")
    _require(
        len(node.pages) > 0 and len(node.key) == len(node.pages) * page_size,
        f"{node!r}: key of {len(node.key)} tokens vs {len(node.pages)} pages of {page_size}",
    )
    first_page = node.key[:page_size]
    expected_key = (node.namespace, first_page) if parent is root else first_page
    _require(child_key == expected_key, f"{node!r} is filed under the wrong child key")
    if parent is not root:
        _require(node.namespace == parent.namespace, f"{node!r} namespace differs from its parent's")
    _require(node.lock_ref >= 0, f"{node!r} has a negative lock_ref")
    if parent is not root:
        _require(parent.lock_ref >= node.lock_ref, f"{node!r} is locked more than its parent {parent!r}")
    parent_hash = parent.hash
    seed = parent_hash if parent_hash is not None else namespace_seed(node.namespace)
    _require(node.hashes == chain_hashes(seed, node.key, page_size), f"{node!r} page hashes do not chain")


def _check_pages(node: TreeNode, seen: set[int]) -> None:
    for page in node.pages:
        _require(page != 0, f"{node!r} holds the reserved page 0")
        _require(page not in seen, f"page {page} appears twice in the tree (in {node!r})")
        seen.add(page)


def _check_held(held_pages: Iterable[int], tree_pages: set[int]) -> None:
    held: set[int] = set()
    for page in held_pages:
        _require(page != 0, "a request holds the reserved page 0")
        _require(page not in tree_pages, f"page {page} is owned by both the tree and a request")
        _require(page not in held, f"page {page} is held twice by requests")
        held.add(page)
