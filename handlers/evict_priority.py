"""Priority: evict prefixes of low-priority requests first; among equals, least recently used.

A node's priority is the highest priority of the requests that inserted or matched it
(larger = more important), so a prefix shared with an important request is kept.
"""

from __future__ import annotations

from cache.evict_policy import EvictPolicy
from cache.radix_node import TreeNode
from kernel.registry import register


@register("evict", "priority")
class PriorityLRU(EvictPolicy):
    def key(self, node: TreeNode) -> tuple[float, ...]:
        return (node.priority, node.last_access)
