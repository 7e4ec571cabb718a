"""Overlap scheduling on or off: output tokens per second, measured interleaved.

Builds two engines from the same config, `scheduler.overlap: off` and `on`, and runs the
same batch of requests on each in turn (off, on, off, on, ...) so both see the same
machine load; prints each round's tokens/s and the ratio of the medians (on / off). The
outputs are compared too (they must be equal in deterministic mode, and are reported).

    .venv/bin/python benchmarks/overlap.py                          # packaged SmolLM2, default config
    .venv/bin/python benchmarks/overlap.py --requests 16 --tokens 64 --rounds 5
    .venv/bin/python benchmarks/overlap.py --set model.num_threads=1 --set deterministic=true
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.serving import Progress
from kernel import Engine


def parse_sets(items: list[str]) -> dict[str, Any]:
    return {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in items)}


def prompts(n: int, length: int) -> list[list[int]]:
    return [[1000 + 37 * i + j for j in range(length)] for i in range(n)]


def one_round(engine: Engine, batch: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    assert engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(batch, params)
    elapsed = time.perf_counter() - t0
    assert isinstance(outs, list)
    return len(batch) * tokens / elapsed, [o["output_ids"] for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "config" / "default.yaml"))
    ap.add_argument("--set", action="append", default=[], help="dotted override, e.g. model.num_threads=1")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    overrides = parse_sets(args.set)
    engines = {mode: Engine(args.config, {**overrides, "scheduler.overlap": mode}) for mode in ("off", "on")}
    batch = prompts(args.requests, args.prompt_len)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    same = True
    try:
        for engine in engines.values():
            one_round(engine, batch[:2], 4)  # warm-up
        progress = Progress("overlap rounds", 2 * args.rounds, enabled=True)
        for _ in range(args.rounds):
            ref: list[list[int]] | None = None
            for mode, engine in engines.items():
                rate, ids = one_round(engine, batch, args.tokens)
                rates[mode].append(rate)
                same = same and (ref is None or ids == ref)
                ref = ids
                progress.tick()
        overlapped = engines["on"].engine.loop.overlapped
    finally:
        for engine in engines.values():
            engine.shutdown()
    for mode, values in rates.items():
        print(f"overlap {mode:3s}: " + "  ".join(f"{v:7.1f}" for v in values) + " tok/s")
    ratio = statistics.median(rates["on"]) / statistics.median(rates["off"])
    paired = statistics.geometric_mean([b / a for a, b in zip(rates["off"], rates["on"])])
    print(f"median on/off = {ratio:.3f}   geometric mean of per-round on/off = {paired:.3f}")
    print(f"steps overlapped: {overlapped}; outputs equal: {same}")


if __name__ == "__main__":
    main()
