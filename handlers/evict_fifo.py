"""First in, first out: the earliest inserted leaf goes first, however often it is hit."""

from __future__ import annotations

from cache.evict_policy import EvictPolicy
from cache.radix_node import TreeNode
from kernel.registry import register


@register("evict", "fifo")
class FIFO(EvictPolicy):
    def key(self, node: TreeNode) -> tuple[float, ...]:
        return (node.created,)
