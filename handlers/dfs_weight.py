"""DFS by weight: walk the prefix tree from the root, heaviest subtree first (weight =
waiting requests whose cached prefix ends there or below), emitting each node's requests
on the way. Requests that share a prefix are admitted together, while it is cached."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from cache.radix_node import TreeNode
from kernel.registry import register
from kernel.request import Request
from kernel.scheduling.policy import SchedulePolicy
from kernel.scheduling.prefix_reuse import PrefixReuse


@register("schedule", "dfs_weight")
class DFSWeight(SchedulePolicy):
    def order(self, waiting: Sequence[Request], prefix: PrefixReuse) -> list[Request]:
        at_node: dict[int, list[Request]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        children: dict[int, dict[int, TreeNode]] = defaultdict(dict)
        roots: dict[int, TreeNode] = {}
        unmatched: list[Request] = []
        for req in waiting:
            node = prefix.probe(req).node
            if node is None or node.parent is None:
                unmatched.append(req)
                continue
            at_node[node.id].append(req)
            while node.parent is not None:  # credit every node on the path
                weight[node.id] += 1
                if node.parent.parent is None:
                    roots[node.id] = node
                else:
                    children[node.parent.id][node.id] = node
                node = node.parent
        ordered: list[Request] = []
        stack = sorted(roots.values(), key=lambda n: weight[n.id])  # heaviest popped first
        while stack:
            node = stack.pop()
            ordered.extend(sorted(at_node[node.id], key=lambda r: r.arrival))
            stack.extend(sorted(children[node.id].values(), key=lambda n: weight[n.id]))
        return ordered + sorted(unmatched, key=lambda r: r.arrival)
