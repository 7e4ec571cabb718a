"""Full consistency check of a radix tree (debug.check_invariants and tests). O(tree)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from cache.kv_events import chain_hashes, namespace_seed
from cache.radix_node import TreeNode


class TreeIntegrityError(AssertionError):
    """The tree broke one of its invariants; the message names the node and the rule."""


class StateBook(NamedTuple):
    """A hybrid tree's state bookkeeping, as the tree maintains it."""

    total: int  # slots the tree owns
    evictable: int  # of which on unlocked nodes
    heap_live: set[int]  # ids of nodes with a current state-heap entry


class HostBook(NamedTuple):
    """A tiered tree's host-copy bookkeeping, as the tree maintains it."""

    total: int  # host pages the tree owns
    evictable: int  # of which on unlocked nodes
    heap_live: set[int]  # ids of nodes with a current host-heap entry


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TreeIntegrityError(message)


def check_tree(
    root: TreeNode,
    page_size: int,
    counters: tuple[int, int, int, int],
    heap_live: set[int],
    held_pages: Iterable[int] = (),
    states: StateBook | None = None,
    held_states: Iterable[int] = (),
    host: HostBook | None = None,
    held_host_pages: Iterable[int] = (),
) -> None:
    """Check structure, page ownership, locks, hashes, counters and the eviction heap,
    for a hybrid tree (`states` given) the state slots, and for a tiered tree (`host`
    given) residency and host copies.

    counters: (total, evictable, protected, num_nodes) as the tree maintains them.
    heap_live: ids of nodes with a current (non-stale) heap entry.
    held_pages: pages owned by live requests; none may also be owned by the tree.
    held_states: state slots owned by live requests; none may also be owned by the tree.
    held_host_pages: host pages owned by callers (copies in flight); none may be the tree's.
    """
    _require(root.parent is None and not root.key and not root.pages, "root must be empty and parentless")
    _require(root.lock_ref == 0, f"root lock_ref is {root.lock_ref}, roots are never counted")
    _require(root.state_slot is None, "the root holds a state slot: it is always a fresh state")
    seen_pages: set[int] = set()
    seen_host: set[int] = set()
    slots: dict[int, TreeNode] = {}
    total = evictable = protected = num_nodes = host_total = host_evictable = 0
    stack = [(root, 0)]
    while stack:
        parent, depth = stack.pop()
        for child_key, node in parent.children.items():
            _check_node(node, parent, root, child_key, page_size)
            _check_residency(node, parent, root, page_size, host is not None)
            _check_pages(node, seen_pages)
            if node.host_pages is not None:
                _check_pages(node, seen_host, node.host_pages, "host page")
                host_total += len(node.host_pages)
                host_evictable += 0 if node.lock_ref else len(node.host_pages)
            if host is not None and node.is_host_candidate:
                _require(
                    node.id in host.heap_live, f"{node!r} is a host candidate missing from the host heap"
                )
            _check_state(node, depth + len(node.key), slots, states)
            num_nodes += 1
            total += len(node.pages)
            if node.lock_ref:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
            if node.is_evictable_leaf:
                _require(node.id in heap_live, f"{node!r} is an unlocked leaf missing from the eviction heap")
            stack.append((node, depth + len(node.key)))
    _check_held(held_pages, seen_pages)
    _check_held(held_states, set(slots), "state slot")
    _check_held(held_host_pages, seen_host, "host page")
    if host is not None:
        recount_host = (host_total, host_evictable)
        _require(
            recount_host == (host.total, host.evictable),
            f"host counters (total, evictable) {(host.total, host.evictable)} != recount {recount_host}",
        )
    if states is not None:
        _check_state_book(slots, states)
    recount = (total, evictable, protected, num_nodes)
    _require(
        recount == counters, f"counters (total, evictable, protected, nodes) {counters} != recount {recount}"
    )


def _check_node(node: TreeNode, parent: TreeNode, root: TreeNode, child_key: object, page_size: int) -> None:
    _require(node.parent is parent, f"{node!r} does not point back to its parent {parent!r}")
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


def _check_residency(node: TreeNode, parent: TreeNode, root: TreeNode, page_size: int, tiered: bool) -> None:
    """Device pages and host copies: one per page of the key each where present, and
    NOTE: the top-subtree invariant: a device-resident node's parent is device-resident."""
    resident = len(node.pages) or (len(node.host_pages) if node.host_pages is not None else 0)
    _require(
        resident > 0 and len(node.key) == resident * page_size,
        f"{node!r}: key of {len(node.key)} tokens vs {resident} pages of {page_size}",
    )
    if not tiered:
        _require(node.host_pages is None, f"{node!r} holds host pages in a tree without a host tier")
    elif node.pages and node.host_pages is not None:
        _require(
            len(node.host_pages) == len(node.pages),
            f"{node!r}: {len(node.host_pages)} host pages for {len(node.pages)} device pages",
        )
    if node.pages and parent is not root:
        _require(bool(parent.pages), f"{node!r} is device-resident under host-only {parent!r}")
    device_children = sum(1 for child in node.children.values() if child.pages)
    _require(
        node.device_children == device_children,
        f"{node!r} counts {node.device_children} device children, has {device_children}",
    )


def _check_pages(node: TreeNode, seen: set[int], pages: list[int] | None = None, what: str = "page") -> None:
    for page in node.pages if pages is None else pages:
        _require(page != 0, f"{node!r} holds the reserved {what} 0")
        _require(page not in seen, f"{what} {page} appears twice in the tree (in {node!r})")
        seen.add(page)


def _check_held(held_ids: Iterable[int], tree_ids: set[int], what: str = "page") -> None:
    """Ids (pages, or state slots) requests hold: never the reserved 0, never also the
    tree's, never held twice."""
    held: set[int] = set()
    for item in held_ids:
        _require(item != 0, f"a request holds the reserved {what} 0")
        _require(item not in tree_ids, f"{what} {item} is owned by both the tree and a request")
        _require(item not in held, f"{what} {item} is held twice by requests")
        held.add(item)


def _check_state(node: TreeNode, end: int, slots: dict[int, TreeNode], states: StateBook | None) -> None:
    """NOTE: invariant 2: a slot covers exactly its node's key length from the root."""
    slot = node.state_slot
    if slot is None:
        _require(node.state_len is None, f"{node!r} records a state length without a state slot")
        return
    _require(states is not None, f"{node!r} holds state slot {slot} in a dense tree")
    _require(slot != 0, f"{node!r} holds the reserved state slot 0")
    _require(slot not in slots, f"state slot {slot} appears twice in the tree (in {node!r})")
    _require(
        node.state_len == end,
        f"{node!r}: state slot {slot} covers {node.state_len} tokens, the node ends at {end}",
    )
    slots[slot] = node


def _check_state_book(slots: dict[int, TreeNode], states: StateBook) -> None:
    evictable = 0
    for node in slots.values():
        if node.lock_ref == 0:
            evictable += 1
            _require(
                node.id in states.heap_live, f"{node!r}: an unlocked state slot missing from the state heap"
            )
    recount = (len(slots), evictable)
    _require(
        recount == (states.total, states.evictable),
        f"state counters (total, evictable) {(states.total, states.evictable)} != recount {recount}",
    )
