"""Decode attention alone: the torch backend's prepare + every layer's forward for a step
of `--requests` decodes (SmolLM2's head shapes and layer count, each layer its own pool
tensors, so a step streams its K/V from memory as the model's does) over pages anywhere in
the pool (`--layout shuffled`) or as the engine hands them out (`--layout served`).

    .venv/bin/python benchmarks/decode_attention.py --kernel
    .venv/bin/python benchmarks/decode_attention.py --compare ../main --rounds 5

`--kernel` alternates subprocesses running this tree's torch path (cpu_kernels off) and
its C++ paged decode kernel (cpu_kernels on); `--compare TREE` alternates TREE's backend
and this repo's (both on the torch path unless --kernel is given too). Each batch size of
`--requests` prints the median of each variant, in ms of wall time per step (all layers;
`--threads` threads, as the engine runs) and the CPU time of all threads, and the ratio.
On a busy shared machine use `--threads 1`: a second thread that waits for a core turns
every parallel op into a wait of a scheduler slice, and the 2-thread times mean nothing.
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
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
PAGE, KV_HEADS, HEADS, HEAD_DIM, LAYERS = 16, 3, 9, 64, 30  # SmolLM2-135M


class Variant(NamedTuple):
    tree: Path
    kernel: bool

    def __str__(self) -> str:
        return f"{self.tree.name}:{'kernel' if self.kernel else 'torch'}"


def page_order(args: argparse.Namespace, lens: list[int], rng: random.Random) -> list[list[int]]:
    """Each row's pages. `shuffled`: every page anywhere in the pool. `served`: as the engine
    hands them out to requests admitted together, a row's prompt pages in one run, then the
    pages of its last `--decoded` tokens one at a time, in turn with the other rows'."""
    counts = [n // PAGE + 1 for n in lens]
    if args.layout == "shuffled":
        free = list(range(1, sum(counts) + 1))
        rng.shuffle(free)
        return [[free.pop() for _ in range(c)] for c in counts]
    prompt = [max(1, (n - args.decoded) // PAGE + 1) for n in lens]
    pages: list[list[int]] = []
    next_page = 1
    for c in prompt:
        pages.append(list(range(next_page, next_page + c)))
        next_page += c
    while any(len(row) < c for row, c in zip(pages, counts)):
        for row, c in zip(pages, counts):
            if len(row) < c:
                row.append(next_page)
                next_page += 1
    return pages


def layout(args: argparse.Namespace) -> tuple[Any, Any, list[int], list[int]]:
    """A pool and a request table whose rows own pages laid out as `--layout` says; (pool,
    table, rows, lengths)."""
    import torch

    from cache.kv_pool import KVPool

    rng = random.Random(args.seed)
    lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.requests)]
    num_pages = sum(n // PAGE + 1 for n in lens) + 16
    dtype = getattr(torch, args.dtype)
    pool = KVPool(args.layers, num_pages, PAGE, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"))
    for cache in (*pool.k, *pool.v):
        cache.normal_()
    table = torch.zeros((args.requests + 1, PAGE * (args.max_len // PAGE + 2)), dtype=torch.int64)
    for row, pages in enumerate(page_order(args, lens, rng), 1):
        table[row, : len(pages) * PAGE] = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])
    return pool, table, list(range(1, args.requests + 1)), lens


def timed(fn: Callable[[], Any], iters: int) -> dict[str, float]:
    """Wall and all-threads CPU ms per call, after one warm-up call."""
    fn()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn()
    return {"ms": (time.perf_counter() - wall) / iters * 1e3, "cpu_ms": (time.process_time() - cpu) / iters * 1e3}


def child(args: argparse.Namespace) -> None:
    import torch

    from gpu.attention.torch_backend import TorchAttention

    torch.set_num_threads(args.threads)
    pool, table, rows, lens = layout(args)
    gen = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(len(rows), HEADS, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(len(rows), KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    attn = TorchAttention(pool, table, cpu_kernels=args.use_kernel)
    if args.use_kernel and not getattr(attn, "_use_kernel", False):
        raise SystemExit("the paged attention kernel is not available in this tree")

    def step() -> None:
        attn.prepare(rows, lens, [1] * len(rows))
        for layer in range(args.layers):
            attn.forward(layer, q, k, v)

    with torch.inference_mode():
        print(json.dumps(timed(step, args.iters)))


def run_variant(variant: Variant, argv: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(variant.tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--tree", str(variant.tree), *argv]
    if variant.kernel:
        cmd.append("--use-kernel")
    out = subprocess.run(cmd, env=env, cwd=variant.tree, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def measure(args: argparse.Namespace, variants: list[Variant], requests: int) -> None:
    keys = ("min_len", "max_len", "layers", "threads", "dtype", "iters", "seed", "layout", "decoded")
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys] + [f"--requests={requests}"]
    times: dict[Variant, list[dict[str, float]]] = {v: [] for v in variants}
    for i in range(args.rounds):
        for variant in variants if i % 2 == 0 else variants[::-1]:  # alternate who goes first
            print(f"requests {requests} round {i + 1}/{args.rounds}: {variant}", file=sys.stderr, flush=True)
            times[variant].append(run_variant(variant, argv))
    med = {v: statistics.median(x["ms"] for x in xs) for v, xs in times.items()}
    print(f"{requests} decodes, {args.min_len}-{args.max_len} keys, {args.dtype}, {args.layers} layers, {args.layout} pages:")
    for variant, xs in times.items():
        cpu = statistics.median(x["cpu_ms"] for x in xs)
        runs = ", ".join(f"{x['ms']:.2f}" for x in xs)
        print(f"  {variant!s:24} median {med[variant]:8.3f} ms/step  CPU {cpu:8.3f} ms/step  ({runs})")
    if len(variants) == 2:
        print(f"  ratio ({variants[1]} / {variants[0]}): {med[variants[1]] / med[variants[0]]:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="1,32,64", help="batch sizes, comma-separated")
    p.add_argument("--min-len", type=int, default=150)
    p.add_argument("--max-len", type=int, default=700)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default="shuffled", choices=("shuffled", "served"), help="where rows' pages lie")
    p.add_argument("--decoded", type=int, default=96, help="with --layout served: tokens each row has decoded")
    p.add_argument("--kernel", action="store_true", help="the torch path vs the C++ kernel, this tree")
    p.add_argument("--compare", type=Path, metavar="TREE")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--use-kernel", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.requests = int(args.requests)
        child(args)
        return
    if args.compare:
        variants = [Variant(args.compare.resolve(), args.kernel), Variant(REPO, args.kernel)]
    else:
        variants = [Variant(REPO, False), Variant(REPO, True)] if args.kernel else [Variant(REPO, False)]
    for requests in (int(r) for r in args.requests.split(",")):
        measure(args, variants, requests)


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else str(REPO))
    main()
