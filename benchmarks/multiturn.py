"""Multi-turn chat against a device pool far smaller than the sessions' contexts: TTFT,
throughput and per-tier hit rates with the device pool alone, with the host tier, and —
once the storage tier exists (`kernel.config.HicacheConfig` has a `storage` field) — with
the host tier plus a file storage tier below it, in one invocation (in the spirit of
SGLang's benchmark/hicache/bench_multiturn.py: many concurrent multi-turn sessions whose
total context is several times the device pool).

`--sessions` sessions each run `--turns` turns; a session opens with its own
`--system-tokens` prompt, and a turn sends the whole conversation so far plus
`--user-tokens` new tokens and generates `--output-tokens`. Round by round, every session
sends its next turn, `--concurrency` turns in flight at once. The device pool
(`--device-pages`) holds the turns in flight but only a fraction of all sessions'
context, so without a lower tier a session's history has been evicted by the time its
next turn comes and is computed again; with the host tier it is loaded back.

Defaults: 16 sessions x 6 turns (SGLang's bench runs 5 rounds; real chats grow longer,
which is where the tiers pay off), a 256-token opening prompt per session, 128 user
tokens and 32 output tokens per turn, 4 turns in flight, a device pool of 320 pages of 16
tokens (~5.1k tokens: the 4 longest turns in flight fit, all sessions' context is ~3.8x
it), a host pool of 2048 pages (all sessions' context fits). The "+host+file" run gets
half the host pool (`--storage-host-pages`), so that histories are pushed out of host
memory and come back from the file tier (a fresh temporary directory). Every variant
is a fresh engine in this process; the ratio columns are device-only mean TTFT over
each column's.

    .venv/bin/python benchmarks/multiturn.py
    .venv/bin/python benchmarks/multiturn.py --sessions 8 --turns 3 --device-pages 128   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from typing import Any

from throughput import REPO, add_engine_args  # type: ignore[import-not-found]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="turns in flight at once")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=256, help="the opening prompt of each session")
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--device-pages", type=int, default=320)
    p.add_argument("--host-pages", type=int, default=2048)
    p.add_argument("--storage-host-pages", type=int, default=None,
                   help="host pool of the +host+file run (default: half of --host-pages)")
    p.add_argument("--storage-max-bytes", type=int, default=4 << 30, help="file tier capacity")
    p.add_argument("--no-storage", action="store_true", help="skip the +host+file run")
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)
    return p.parse_args()


class Progress:
    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0

    def tick(self) -> None:
        self.done += 1
        filled = self.done * 30 // self.total
        end = "\n" if self.done == self.total else ""
        print(f"\r{self.label:<12} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}",
              end=end, file=sys.stderr, flush=True)


class Session:
    def __init__(self, rng: random.Random, args: argparse.Namespace) -> None:
        self.rng = rng
        self.history = [rng.randrange(100, 40000) for _ in range(args.system_tokens)]

    async def turn(self, engine: Any, args: argparse.Namespace, gate: asyncio.Semaphore,
                   records: list[dict[str, Any]], progress: Progress) -> None:
        self.history += [self.rng.randrange(100, 40000) for _ in range(args.user_tokens)]
        params = {"max_new_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True}
        async with gate:
            t0 = time.perf_counter()
            rid = engine.add_request(self.history, params)
            ttft, last = None, None
            async for chunk in engine.stream(rid):
                if ttft is None and chunk.token_ids:
                    ttft = time.perf_counter() - t0
                self.history += chunk.token_ids
                last = chunk
        assert last is not None and ttft is not None
        records.append({"ttft": ttft, "prompt": last.prompt_tokens, "tiers": last.cached_by_tier,
                        "output": last.completion_tokens})
        progress.tick()


async def run(label: str, args: argparse.Namespace, overrides: dict[str, Any]) -> dict[str, Any]:
    from kernel.async_engine import AsyncEngine

    path = args.config if (REPO / args.config).exists() is False else str(REPO / args.config)
    engine = await AsyncEngine.create(path, overrides)
    records: list[dict[str, Any]] = []
    progress = Progress(label, args.sessions * args.turns)
    try:
        await engine.generate(list(range(100, 164)), {"max_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        sessions = [Session(random.Random(args.seed * 1000 + s), args) for s in range(args.sessions)]
        gate = asyncio.Semaphore(args.concurrency)
        for _ in range(args.turns):  # round by round: every session's next turn, a few at a time
            await asyncio.gather(*(s.turn(engine, args, gate, records, progress) for s in sessions))
        wall = time.perf_counter() - t0
        stats = engine.stats()
        for tier in ("host", "storage"):
            if stats.get(tier) is not None:
                print(f"{label}: {tier} tier {stats[tier]}", file=sys.stderr)
        retractions = stats["num_retractions"]
    finally:
        await engine.shutdown()
    ttfts = sorted(r["ttft"] for r in records)
    prompt = sum(r["prompt"] for r in records)
    return {
        "label": label, "mean": statistics.mean(ttfts), "p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "tok_s": sum(r["output"] for r in records) / wall, "wall": wall,
        "device": sum(r["tiers"].get("device", 0) for r in records) / prompt,
        "host": sum(r["tiers"].get("host", 0) for r in records) / prompt,
        "storage": sum(r["tiers"].get("storage", 0) for r in records) / prompt,
        "retractions": retractions,
    }


def has_storage_tier() -> bool:
    """Whether this checkout has the storage tier (its `hicache.storage` key)."""
    from kernel.config import HicacheConfig

    return "storage" in {f.name for f in dataclasses.fields(HicacheConfig)}


def main() -> int:
    args = parse_args()
    from kernel.config import parse_set_args

    base = {**parse_set_args(args.set), "cache.prefix": "radix", "cache.num_pages": args.device_pages,
            "logging.level": "warning"}
    total = args.sessions * (args.system_tokens + args.turns * (args.user_tokens + args.output_tokens))
    pool = (args.device_pages - 1) * 16
    print(f"{args.sessions} sessions x {args.turns} turns, total context {total} tokens vs a device pool of "
          f"~{pool} tokens ({total / pool:.1f}x)", file=sys.stderr)
    rows = [
        asyncio.run(run("device only", args, base)),
        asyncio.run(run("+host", args, {**base, "hicache.host_pages": args.host_pages})),
    ]
    if not args.no_storage and has_storage_tier():
        host_pages = args.storage_host_pages or args.host_pages // 2
        with tempfile.TemporaryDirectory(prefix="tierserve-multiturn-") as storage_dir:
            rows.append(asyncio.run(run("+host+file", args, {
                **base, "hicache.host_pages": host_pages, "hicache.storage": "file",
                "hicache.storage_dir": storage_dir, "hicache.storage_max_bytes": args.storage_max_bytes,
            })))
    elif not args.no_storage:
        print("(no storage tier in this checkout: the +host+file run is skipped)", file=sys.stderr)
    base_mean = rows[0]["mean"]
    print(f"{'config':<12} | mean TTFT s | vs device | p90 TTFT s | out tok/s | wall s | device hit | host hit"
          f" | storage hit | retractions")
    for r in rows:
        print(f"{r['label']:<12} | {r['mean']:11.3f} | {base_mean / r['mean']:8.2f}x | {r['p90']:10.3f} | "
              f"{r['tok_s']:9.1f} | {r['wall']:6.1f} | {r['device']:10.1%} | {r['host']:8.1%} | "
              f"{r['storage']:11.1%} | {r['retractions']:11d}")
    for r in rows[1:]:
        print(f"mean TTFT: device only / {r['label']} = {base_mean / r['mean']:.2f}x; "
              f"p90 {rows[0]['p90'] / r['p90']:.2f}x; throughput {r['tok_s'] / rows[0]['tok_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
