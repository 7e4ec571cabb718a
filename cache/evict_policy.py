"""Abstract base of the eviction policies (implementations: handlers/evict_*.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from cache.radix_node import TreeNode


class EvictPolicy(ABC):
    """Orders evictable leaves of the radix tree.

    Contract: `key(node)` returns a tuple; the smaller key is evicted first (ties go to the
    lower node id). The tree computes a node's key when the node becomes an eviction
    candidate (an unlocked leaf) and again whenever it is touched by `match` or `insert`,
    and keeps that snapshot in a heap. So a key may depend only on the node's own stats
    that change on touch (`last_access`, `hit_count`, `priority`) or never change
    (`created`, `id`); a key reading anything else (the wall clock now, other nodes) goes
    stale silently. `key` must be cheap and pure: it runs on every touch of a leaf.
    """

    @abstractmethod
    def key(self, node: TreeNode) -> tuple[float, ...]: ...
