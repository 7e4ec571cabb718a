"""Least recently used: evict the leaf whose last match or insert is oldest."""

from __future__ import annotations

from cache.evict_policy import EvictPolicy
from cache.radix_node import TreeNode
from kernel.registry import register


@register("evict", "lru")
class LRU(EvictPolicy):
    def key(self, node: TreeNode) -> tuple[float, ...]:
        return (node.last_access,)
