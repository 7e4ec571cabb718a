"""Batch-1 greedy decode speed of the packaged model (config/default.yaml: bfloat16 + int4)
with `model.cpu_kernels: off` (torch's quantized ops) vs `auto` (tierserve's C++ kernels),
both engines alive in one process and their requests interleaved round by round, so that
machine noise hits both alike. Prints each round's decode tok/s (time from the first to the
last streamed token) and the best and median of each setting and their ratio.

    .venv/bin/python benchmarks/quant_decode.py --rounds 5 --tokens 128
    .venv/bin/python benchmarks/quant_decode.py --set model.quantization=int8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import Progress
from kernel.async_engine import AsyncEngine
from kernel.config import load_config, parse_set_args

CONFIG = str(Path(__file__).resolve().parent.parent / "config" / "default.yaml")
SETTINGS = ("off", "auto")  # model.cpu_kernels


async def decode_tok_s(engine: AsyncEngine, prompt: list[int], tokens: int) -> float:
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": tokens}
    stamps = [time.perf_counter() async for _ in engine.stream(engine.add_request(prompt, params))]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


async def run(args: argparse.Namespace) -> None:
    engines: dict[str, Any] = {}
    for setting in SETTINGS:
        overrides = {**parse_set_args(args.set), "model.cpu_kernels": setting}  # "off" would parse as False
        engines[setting] = await AsyncEngine.create(load_config(CONFIG, overrides))
    speeds: dict[str, list[float]] = {s: [] for s in SETTINGS}
    progress = Progress("decode", args.rounds * len(SETTINGS), enabled=True)
    try:
        for engine in engines.values():  # warm-up (kernel builds, first allocations)
            await decode_tok_s(engine, list(range(1000, 1100)), 8)
        for r in range(args.rounds):
            # a different prompt per round, so that no prefix is cached across rounds
            prompt = list(range(2000 + r, 2100 + r))
            for setting, engine in engines.items():
                speeds[setting].append(await decode_tok_s(engine, prompt, args.tokens))
                progress.tick()
            print(f"round {r}: " + "  ".join(f"{s} {speeds[s][-1]:.1f} tok/s" for s in SETTINGS), flush=True)
    finally:
        for engine in engines.values():
            await engine.shutdown()
    best = {s: max(v) for s, v in speeds.items()}
    median = {s: statistics.median(v) for s, v in speeds.items()}
    for s in SETTINGS:
        print(f"cpu_kernels {s:>4}: best {best[s]:.1f} tok/s, median {median[s]:.1f} tok/s")
    print(f"auto / off: best {best['auto'] / best['off']:.3f}, median {median['auto'] / median['off']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides key=value for both engines")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
