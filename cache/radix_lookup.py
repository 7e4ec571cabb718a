"""Read-only lookups of the radix tree's tokens (no split, no stats, no lock).

`continuation`: the tokens the tree holds right after a sequence — what followed the same
prefix in sequences computed before (speculative decoding drafts them: a repeated
prompt, `n` > 1, a retried request). Whole-page keys mean a sequence usually ends inside
a page: the tree is walked by whole pages, then the partial tail is matched against the
start of a child's key.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache.radix_node import TreeNode


def continuation(root: TreeNode, page_size: int, tokens: Sequence[int], namespace: str | None,
                 count: int) -> list[int]:
    """Up to `count` tokens that follow `tokens` in the tree ([] where none is known).
    Past a node's end it goes on into the child touched last."""
    node, pos = root, 0
    while len(tokens) - pos >= page_size:
        page = tuple(tokens[pos : pos + page_size])
        child = node.children.get((namespace, page) if node is root else page)
        if child is None:
            return []
        rest = tokens[pos:]
        if len(child.key) >= len(rest):  # the sequence ends inside this node
            if tuple(rest) != child.key[: len(rest)]:
                return []
            return follow(child, len(rest), count)
        if child.key != tuple(tokens[pos : pos + len(child.key)]):
            return []
        node, pos = child, pos + len(child.key)
    tail = tuple(tokens[pos:])
    for child in _ordered(node, root, namespace):
        if child.key[: len(tail)] == tail:
            return follow(child, len(tail), count)
    return []


def follow(node: TreeNode, offset: int, count: int) -> list[int]:
    """Up to `count` tokens from offset `offset` of `node` on, into the children touched last."""
    out = list(node.key[offset : offset + count])
    while len(out) < count:
        children = _ordered(node, None, None)
        if not children:
            break
        node = children[0]
        out += node.key[: count - len(out)]
    return out


def _ordered(node: TreeNode, root: TreeNode | None, namespace: str | None) -> list[TreeNode]:
    """`node`'s children, the one touched last first (at the root: of `namespace` only)."""
    children = [c for c in node.children.values() if node is not root or c.namespace == namespace]
    return sorted(children, key=lambda c: -c.last_access)
