"""Least frequently used: fewest hits first; among equals, the least recently used."""

from __future__ import annotations

from cache.evict_policy import EvictPolicy
from cache.radix_node import TreeNode
from kernel.registry import register


@register("evict", "lfu")
class LFU(EvictPolicy):
    def key(self, node: TreeNode) -> tuple[float, ...]:
        return (node.hit_count, node.last_access)
