"""Radix tree eviction cost on a big tree: heap `evict` vs a full-scan baseline, same run.

Builds a tree of ~100k nodes the way shared system prompts do (P prompts of 2 pages,
each with L one-page continuations: P * (1 + L) nodes), churns it with random matches
and some locked leaves so the heap holds stale entries, then times `evict` calls.
The baseline is the per-call cost of finding the same victim by scanning every node.

    .venv/bin/python benchmarks/evict_bench.py
    .venv/bin/python benchmarks/evict_bench.py --prompts 100 --leaves 99 --calls 2000   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/evict_bench.py` puts benchmarks/ on the path

from cache.allocator import PageAllocator
from cache.radix_tree import RadixTree, TreeNode
from kernel.registry import lookup

POLICY_MODULES = (
    "handlers.evict_lru",
    "handlers.evict_lfu",
    "handlers.evict_fifo",
    "handlers.evict_priority",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=1000, help="shared 2-page prefixes")
    p.add_argument("--leaves", type=int, default=99, help="one-page continuations per prefix")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--calls", type=int, default=10000, help="timed evict(1) calls")
    p.add_argument("--churn", type=int, default=100000, help="random matches before timing")
    p.add_argument("--locked", type=float, default=0.05, help="fraction of leaves locked")
    p.add_argument("--policy", default="lru")
    p.add_argument("--baseline-calls", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build(args: argparse.Namespace) -> tuple[RadixTree, list[list[int]], float]:
    """The tree plus every inserted sequence; returns the build time per insert."""
    rng = random.Random(args.seed)
    ps = args.page_size
    alloc = PageAllocator(args.prompts * (2 + args.leaves) + 4)  # +3: an insert holds 3 fresh pages at once
    for module in POLICY_MODULES:
        __import__(module)  # register the policies (the registry's built-in list may not name them yet)
    tree = RadixTree(ps, alloc.free, lookup("evict", args.policy)())
    seqs: list[list[int]] = []
    start = time.perf_counter()
    for _ in range(args.prompts):
        prefix = [rng.randrange(50000) for _ in range(2 * ps)]
        for _ in range(args.leaves):
            tokens = prefix + [rng.randrange(50000) for _ in range(ps)]
            pages = alloc.allocate(3)
            result = tree.insert(tokens, pages)
            alloc.free(result.duplicates(pages))
            seqs.append(tokens)
    return tree, seqs, (time.perf_counter() - start) / len(seqs)


def churn(
    tree: RadixTree, seqs: list[list[int]], args: argparse.Namespace
) -> tuple[list[TreeNode], list[float]]:
    """Random matches (each re-keys a leaf, leaving a stale heap entry), then lock a few leaves.

    Returns each match's time in microseconds: the slowest ones include the heap's
    occasional compaction of stale entries.
    """
    rng = random.Random(args.seed + 1)
    samples = []
    for _ in range(args.churn):
        tokens = rng.choice(seqs)
        start = time.perf_counter_ns()
        tree.match(tokens)
        samples.append((time.perf_counter_ns() - start) / 1e3)
    locked = [tree.match(s).node for s in rng.sample(seqs, int(len(seqs) * args.locked))]
    for node in locked:
        tree.lock(node)
    return locked, samples


class GcPauses:
    """Records collector pauses, so a slow call can be told apart from a slow tree."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self._start = 0.0
        gc.callbacks.append(self._record)

    def _record(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif info["generation"] == 2:
            self.pauses_ms.append((time.perf_counter() - self._start) * 1e3)

    def take(self) -> str:
        pauses, self.pauses_ms = self.pauses_ms, []
        return f"{len(pauses)} full gc pauses, longest {max(pauses, default=0.0):.1f} ms"


def time_evictions(tree: RadixTree, calls: int, num_pages: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        tree.evict(num_pages)
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return samples


def time_full_scan(tree: RadixTree, calls: int) -> float:
    """Microseconds to find one victim by scanning the tree (what the heap avoids)."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        min((tree.policy.key(n), n.id) for n in tree.nodes() if n.is_evictable_leaf)
    return (time.perf_counter_ns() - start) / 1e3 / calls


def describe(label: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[int(len(ordered) * 0.99) - 1]
    return (
        f"{label}: mean {statistics.fmean(samples):.1f} us, p50 {statistics.median(samples):.1f} us, "
        f"p99 {p99:.1f} us, max {ordered[-1]:.1f} us over {len(samples)} calls"
    )


def main() -> None:
    args = parse_args()
    tree, seqs, per_insert = build(args)
    print(
        f"tree: {tree.num_nodes} nodes, {tree.total_pages} pages, page_size {args.page_size}, policy {args.policy}"
    )
    print(f"insert: {per_insert * 1e6:.1f} us per call")
    gc_pauses = GcPauses()
    locked, matches = churn(tree, seqs, args)
    print(describe("match", matches) + f" ({gc_pauses.take()})")
    print(f"{len(locked)} leaves locked; {tree.num_nodes} nodes now")

    scan_us = time_full_scan(tree, args.baseline_calls)
    single = time_evictions(tree, args.calls, 1)
    print(describe("evict(1)", single) + f" ({gc_pauses.take()})")
    print(describe("evict(64)", time_evictions(tree, 100, 64)))
    print(
        f"full-scan baseline: {scan_us:.0f} us per victim; heap evict(1) is {scan_us / statistics.fmean(single):.0f}x faster"
    )
    for node in locked:
        tree.unlock(node)
    tree.check_integrity()


if __name__ == "__main__":
    main()
