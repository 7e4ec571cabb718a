"""What followed an n-gram anywhere in the tree: an index for speculative decoding's n-gram
drafter (other cached sequences, not only the same prefix: radix_lookup.continuation).

On insert, every n-gram (of the lengths asked for) that ends right before a new token is
mapped to that token's node and absolute position, the latest insert winning. Entries are
checked when read, not kept in step with the tree: a split moves a position into a new
upper node (found again by walking up from the node that kept the lower part), and an
evicted node is detached (its entries read as misses). Entries of detached nodes are
dropped when the index outgrows its bound. Namespaces never see each other's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from cache.radix_lookup import follow
from cache.radix_node import TreeNode

Entries = dict[tuple[int, ...], tuple[TreeNode, int]]


class NgramIndex:
    def __init__(self, lengths: Sequence[int], max_entries: int = 1 << 20) -> None:
        self.lengths = tuple(lengths)
        self.max_entries = max_entries
        self._at: dict[str | None, Entries] = {}  # namespace -> n-gram -> (node, end)

    def add(self, namespace: str | None, tokens: Sequence[int], start: int, node: TreeNode) -> None:
        """`node` now holds tokens[start:] of the sequence `tokens` (from the root)."""
        at = self._at.setdefault(namespace, {})
        for n in self.lengths:
            first = max(start, n)  # the n-grams ending at first .. len - 1
            if first >= len(tokens):
                continue
            # NOTE: built by zip over shifted slices, in C: this runs on the event loop for
            # every token a finished request inserts (a Python loop cost ~7 ms a request).
            grams = zip(*(tokens[first - n + i : len(tokens) - n + i] for i in range(n)))
            at.update(zip(grams, zip(repeat(node), range(first, len(tokens)))))
        if sum(len(e) for e in self._at.values()) > self.max_entries:
            self._at = {ns: {k: v for k, v in e.items() if _attached(v[0])} for ns, e in self._at.items()}

    def lookup(self, namespace: str | None, gram: Sequence[int], count: int) -> list[int]:
        """Up to `count` tokens that followed `gram` where it was last inserted ([]: none)."""
        hit = self._at.get(namespace, {}).get(tuple(gram))
        if hit is None or not _attached(hit[0]):
            return []
        node, end = hit
        start = _start(node)
        while end < start:  # a split put the position in an upper node
            assert node.parent is not None
            node = node.parent
            start -= len(node.key)
        if _before(node, end - start, len(gram)) != list(gram):
            return []
        return follow(node, end - start, count)

    def clear(self) -> None:
        self._at.clear()


def _attached(node: TreeNode) -> bool:
    while node.parent is not None:
        node = node.parent
    return not node.key  # reached the root (its key is empty); a detached node stops short


def _start(node: TreeNode) -> int:
    """The absolute position of `node`'s first token."""
    start, up = 0, node.parent
    while up is not None:
        start += len(up.key)
        up = up.parent
    return start


def _before(node: TreeNode, offset: int, n: int) -> list[int]:
    """The n tokens before offset `offset` of `node` (fewer at the root)."""
    out = list(node.key[max(0, offset - n) : offset])
    while len(out) < n and node.parent is not None:
        node = node.parent
        out = list(node.key[max(0, len(node.key) - (n - len(out))) :]) + out
    return out
