"""Decode attention alone: the torch backend's prepare + one layer's forward for a step of
`--requests` decodes over shuffled pages (SmolLM2's head shapes), in thread CPU time on
one thread (a busy shared machine disturbs CPU time far less than wall time).

    .venv/bin/python benchmarks/decode_attention.py
    .venv/bin/python benchmarks/decode_attention.py --compare ../main --rounds 5

`--compare TREE` alternates subprocesses running TREE's backend and this repo's, and
prints the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PAGE, KV_HEADS, HEADS, HEAD_DIM = 16, 3, 9, 64  # SmolLM2-135M


def layout(args: argparse.Namespace) -> tuple[Any, Any, list[int], list[int]]:
    """A pool and a request table whose rows own shuffled pages; (pool, table, rows, lengths)."""
    import torch

    from cache.kv_pool import KVPool

    rng = random.Random(args.seed)
    pool = KVPool(1, args.pages, PAGE, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.requests)]
    table = torch.zeros((args.requests + 1, PAGE * (args.max_len // PAGE + 2)), dtype=torch.int64)
    free = list(range(1, args.pages))
    rng.shuffle(free)
    for row, n in enumerate(lens, 1):
        pages = [free.pop() for _ in range(n // PAGE + 1)]
        table[row, : len(pages) * PAGE] = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])
    return pool, table, list(range(1, args.requests + 1)), lens


def cpu_ms(fn: Callable[[], Any], iters: int) -> float:
    fn()
    t0 = time.thread_time()
    for _ in range(iters):
        fn()
    return (time.thread_time() - t0) / iters * 1e3


def child(args: argparse.Namespace) -> None:
    import torch

    from gpu.attention.torch_backend import TorchAttention

    torch.set_num_threads(1)
    pool, table, rows, lens = layout(args)
    gen = torch.Generator().manual_seed(args.seed)
    q = torch.randn(len(rows), HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(len(rows), KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    attn = TorchAttention(pool, table)

    def step() -> None:
        attn.prepare(rows, lens, [1] * len(rows))
        attn.forward(0, q, k, v)

    with torch.inference_mode():
        print(json.dumps({"ms": cpu_ms(step, args.iters)}))


def run_tree(tree: Path, argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--tree", str(tree), *argv]
    out = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["ms"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--min-len", type=int, default=150)
    p.add_argument("--max-len", type=int, default=500)
    p.add_argument("--pages", type=int, default=4096)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", type=Path, metavar="TREE")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    keys = ("requests", "min_len", "max_len", "pages", "iters", "seed")
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    trees = [args.compare.resolve(), REPO] if args.compare else [REPO]
    times: dict[Path, list[float]] = {t: [] for t in trees}
    for i in range(args.rounds):
        for tree in trees if i % 2 == 0 else trees[::-1]:  # alternate who goes first
            print(f"round {i + 1}/{args.rounds}: {tree}", file=sys.stderr, flush=True)
            times[tree].append(run_tree(tree, argv))
    med = {t: statistics.median(x) for t, x in times.items()}
    for tree, xs in times.items():
        print(
            f"{tree!s:40} median {med[tree]:7.3f} ms CPU per step-layer  ({', '.join(f'{x:.2f}' for x in xs)})"
        )
    if len(trees) == 2:
        print(f"ratio (this / {trees[0].name}): {med[REPO] / med[trees[0]]:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else str(REPO))
    main()
