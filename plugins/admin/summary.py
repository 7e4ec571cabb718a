"""The summarized snapshot: `{"type": "snapshot", "limit": N}` for trees too big to ship whole.

A browser cannot render (or usefully show) a 10k-node tree every half second; it gets
the counts by tier and the N nodes that matter most instead, ranked by hits or tokens.
Pure functions over `describe()` dicts, so tests feed them synthetic trees.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Node = dict[str, Any]
TIERS = ("device", "device+host", "host")
RANKINGS: dict[str, Callable[[Node], tuple[int, int]]] = {
    "hits": lambda n: (n["hit_count"], n["num_tokens"]),
    "tokens": lambda n: (n["num_tokens"], n["hit_count"]),
}


def summarize(nodes: list[Node]) -> dict[str, Any]:
    """Counts over every node but the root (nodes[0], it holds no tokens): nodes and
    tokens per tier, in the storage tier, locked, holding a state slot."""
    per_tier = {tier: {"nodes": 0, "tokens": 0} for tier in TIERS}
    stored = {"nodes": 0, "tokens": 0}
    locked = with_state = tokens = 0
    for node in nodes[1:]:
        bucket = per_tier.setdefault(node["tier"], {"nodes": 0, "tokens": 0})
        bucket["nodes"] += 1
        bucket["tokens"] += node["num_tokens"]
        tokens += node["num_tokens"]
        if node["stored"]:
            stored["nodes"] += 1
            stored["tokens"] += node["num_tokens"]
        locked += node["lock_ref"] > 0
        with_state += node["state_slot"] is not None
    return {"nodes": max(len(nodes) - 1, 0), "tokens": tokens, "tiers": per_tier, "stored": stored,
            "locked": locked, "with_state": with_state}


def limited(nodes: list[Node], limit: int, by: str) -> dict[str, Any]:
    """At most `limit` nodes, root first, in tree order: all of them when they fit,
    else the root and the `limit - 1` top-ranked others (`by`: "hits" or "tokens")."""
    truncated = len(nodes) > limit
    if truncated:
        key = RANKINGS[by]
        top = {id(n) for n in heapq.nlargest(limit - 1, nodes[1:], key=key)}
        kept = [nodes[0], *(n for n in nodes[1:] if id(n) in top)]
    else:
        kept = nodes
    return {"total_nodes": len(nodes), "truncated": truncated, "by": by, "summary": summarize(nodes), "nodes": kept}
