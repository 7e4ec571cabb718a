"""Two replicas behind a router, side by side in one run (issue 26): multi-turn sessions
(benchmarks/multiturn.py's shape: each turn resends the conversation so far, the replies
in it, plus new user words) through `python -m plugins.cluster` layouts:

- `round_robin, no shared tier`: SGLang's gateway, round_robin, replicas without storage;
- `sglang cache_aware` (+ `redis`): SGLang's gateway, cache_aware, without (with) the shared Redis tier;
- `vllm kv_aware` (+ `redis`): vLLM's router following the replicas' ZMQ KV events, without
  (with) the shared tier;
- `one server, 2x memory`: one replica with both replicas' device and host pools, no storage:
  the prefix-hit rate a two-replica layout should reach (issue 26's second target).

Each layout is a fresh cluster (the packaged model, device pools far smaller than all
sessions' context, so histories leave the device). Prompts go to /v1/completions, streamed
(TTFT: the first chunk with text): as text through SGLang's gateway, which takes text
only, and as token ids through vLLM's router, whose kv_aware policy scores token ids (a
replica's /v1/tokenize, before the turn's clock starts).
Printed per layout: mean / p90 TTFT, output tok/s, and the prompt tokens served from each
tier (summed over the replicas' /server_info) and the hit rate over them, then each layout's
mean-TTFT ratio to round-robin (target for kv_aware + redis: <= 0.5x).

    .venv/bin/python benchmarks/cluster.py
    .venv/bin/python benchmarks/cluster.py --sessions 4 --turns 3     # quick
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/cluster.py`

from plugins.cluster import start


class Layout(NamedTuple):
    router: str
    overrides: tuple[str, ...] = ()  # replica settings
    router_args: tuple[str, ...] = ()
    replicas: int = 2
    memory: int = 1  # each replica's device and host pools, in multiples of --device-pages / --host-pages


NO_STORAGE = ("hicache.storage=none",)
LAYOUTS: dict[str, Layout] = {
    "round_robin, no shared tier": Layout("sglang", NO_STORAGE, ("--policy", "round_robin")),
    "sglang cache_aware": Layout("sglang", NO_STORAGE),
    "sglang cache_aware + redis": Layout("sglang"),
    "vllm kv_aware": Layout("vllm", NO_STORAGE),
    "vllm kv_aware + redis": Layout("vllm"),
    # The hit-rate yardstick: one server holding both replicas' device and host memory.
    "one server, 2x memory": Layout("sglang", NO_STORAGE, ("--policy", "round_robin"), replicas=1, memory=2),
}


WORDS = ("harbor", "lantern", "copper", "meadow", "signal", "orchard", "glacier", "thistle", "ember", "quarry",
         "saddle", "violet", "compass", "marble", "willow", "falcon")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def turn(http: aiohttp.ClientSession, url: str, model: str, prompt: str | list[int],
               out: int) -> tuple[float, int, str]:
    """(TTFT, completion tokens, text) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": out, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens, text = 0.0, 0, ""
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = orjson.loads(line[6:])
            for choice in event.get("choices", []):
                if not ttft and choice.get("text"):
                    ttft = time.perf_counter() - t0
                text += choice.get("text", "")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft, tokens, text


async def token_ids(http: aiohttp.ClientSession, replica: str, model: str, text: str) -> list[int]:
    async with http.post(f"{replica}/v1/tokenize", json={"model": model, "prompt": text}) as resp:
        resp.raise_for_status()
        return list((await resp.json())["tokens"])


async def workload(url: str, replica: str, model: str, ids: bool, args: argparse.Namespace
                   ) -> tuple[list[float], int, float]:
    """Text sessions; `ids`: each turn is sent as token ids (vLLM's kv_aware scores ids;
    SGLang's gateway takes text only), tokenized by a replica before its clock starts."""
    rng = random.Random(args.seed)
    histories = [words(rng, args.system_tokens) for _ in range(args.sessions)]
    ttfts: list[float] = []
    tokens = 0
    busy = 0.0
    sem = asyncio.Semaphore(args.concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for _ in range(args.turns):
            async def one(i: int) -> None:
                nonlocal tokens
                async with sem:
                    histories[i] += " " + words(rng, args.user_tokens)
                    prompt: str | list[int] = await token_ids(http, replica, model, histories[i]) if ids else histories[i]
                    ttft, n, text = await turn(http, url, model, prompt, args.output_tokens)
                    ttfts.append(ttft)
                    tokens += n
                    histories[i] += text  # the reply joins the history
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(args.sessions)))
            busy += time.perf_counter() - t0
    return ttfts, tokens, busy


def tier_tokens(replicas: list[Any]) -> dict[str, int]:
    totals = {"device": 0, "host": 0, "storage": 0, "queried": 0}
    for r in replicas:
        with urllib.request.urlopen(f"{r.url}/server_info", timeout=5) as resp:
            info = orjson.loads(resp.read())
        host, storage = info["host"] or {}, info["storage"] or {}
        totals["queried"] += info["cache"]["prefix_query_tokens"]
        totals["device"] += info["cache"]["prefix_hit_tokens"]
        totals["host"] += host.get("host_hit_tokens", 0)
        totals["storage"] += storage.get("hit_tokens", 0)
    return totals


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--device-pages", type=int, default=96, help="each replica's device pool, pages of 16 tokens")
    p.add_argument("--host-pages", type=int, default=96, help="each replica's host pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", default=(), help="run the layouts whose names contain one of these")
    args = p.parse_args()
    rows = []
    for name, layout in LAYOUTS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        sets = (f"cache.num_pages={args.device_pages * layout.memory}",
                f"hicache.host_pages={args.host_pages * layout.memory}", *layout.overrides)
        with tempfile.TemporaryDirectory() as logs:
            cluster = start(layout.replicas, layout.router, overrides=sets, router_args=layout.router_args,
                            log_dir=Path(logs))
            try:
                with urllib.request.urlopen(f"{cluster.replicas[0].url}/server_info", timeout=5) as r:
                    model = orjson.loads(r.read())["served_model_name"]
                ttfts, tokens, secs = asyncio.run(workload(cluster.router_url, cluster.replicas[0].url, model,
                                                           layout.router == "vllm", args))
                tiers = tier_tokens(cluster.replicas)
            finally:
                cluster.stop()
        ttfts.sort()
        rows.append((name, statistics.mean(ttfts), ttfts[int(0.9 * (len(ttfts) - 1))], tokens / secs, tiers))
        print(f"{name}: done in {secs:.1f} s", flush=True)
    base = rows[0][1]
    print(f"\n{'layout':<30} {'mean TTFT s':>11} {'p90 TTFT s':>10} {'out tok/s':>9} {'vs first':>8} {'hit %':>6}  "
          "prompt tokens from device / host / storage (of queried)")
    for name, mean, p90, tput, t in rows:
        hit = 100 * (t["device"] + t["host"] + t["storage"]) / max(1, t["queried"])
        print(f"{name:<30} {mean:>11.3f} {p90:>10.3f} {tput:>9.1f} {mean / base:>7.2f}x {hit:>6.1f}  "
              f"{t['device']} / {t['host']} / {t['storage']} (of {t['queried']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
