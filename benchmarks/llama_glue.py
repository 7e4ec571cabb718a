"""Batch-1 decode with the fused C++ glue (model.cpu_kernels: auto) vs without (off).

Builds two engines from the same config (default: config/default.yaml, the packaged
SmolLM2 in bf16 + int4), `model.cpu_kernels` off and auto, and runs one greedy request of
`--tokens` new tokens on each in turn, `--rounds` times (off, auto, off, auto, ...) so
both see the same machine load. Prints per mode the median decode tok/s (first streamed
token to last), the median model forward ms per decode step and the prefill's forward ms
(a ~100-token prompt), and auto/off ratios.

    .venv/bin/python benchmarks/llama_glue.py
    .venv/bin/python benchmarks/llama_glue.py --rounds 8 --tokens 256
    .venv/bin/python benchmarks/llama_glue.py --cpu-time --set model.num_threads=1   # busy machine

NOTE: the other C++ kernels (attention, quantized linears) follow model.cpu_kernels too, so
on a tree that has them this measures all of them together; the forward time per step is
the model's alone either way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.serving import Progress

MODES = ("off", "auto")
COLUMNS = ("tok_s", "fwd_ms", "prefill_ms")


class ForwardTimer:
    """Seconds of each call of the engine's model forward (the device thread's), on `clock`:
    wall time, or with --cpu-time the device thread's CPU time."""

    def __init__(self, runner: Any, clock: Callable[[], float]) -> None:
        self.seconds: list[float] = []
        forward = runner.model.forward

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            out = forward(*args, **kwargs)
            self.seconds.append(clock() - t0)
            return out

        runner.model.forward = timed


async def build(args: argparse.Namespace, mode: str) -> tuple[Any, ForwardTimer]:
    from kernel.async_engine import AsyncEngine
    from kernel.config import load_config, parse_set_args

    engine = await AsyncEngine.create(
        load_config(args.config, {**parse_set_args(args.set), "model.cpu_kernels": mode})
    )
    timer = ForwardTimer(engine.parts.runner, time.thread_time if args.cpu_time else time.perf_counter)
    return engine, timer


async def decode_once(
    engine: Any, timer: ForwardTimer, prompt: list[int], tokens: int
) -> tuple[float, float, float]:
    """(decode tok/s, median forward ms of the decode steps, the prefill's forward ms) of one
    greedy request."""
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": tokens}
    timer.seconds.clear()
    stamps = [time.perf_counter() async for _ in engine.stream(engine.add_request(prompt, params))]
    decode_steps = timer.seconds[1:]  # the first forward is the prompt's prefill
    tok_s = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return tok_s, statistics.median(decode_steps) * 1e3, timer.seconds[0] * 1e3


async def run(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    engines = {mode: await build(args, mode) for mode in MODES}
    results: dict[str, dict[str, list[float]]] = {mode: {k: [] for k in COLUMNS} for mode in MODES}
    progress = Progress("decode", args.rounds * len(MODES), enabled=True)
    try:
        for engine, timer in engines.values():  # warm-up: first-call costs, caches
            await decode_once(engine, timer, list(range(1000, 1100)), 8)
        for r in range(args.rounds):
            prompt = list(range(2000, 2100 + r))  # a new prompt each round: no prefix hit
            for mode, (engine, timer) in engines.items():
                for key, value in zip(COLUMNS, await decode_once(engine, timer, prompt, args.tokens)):
                    results[mode][key].append(value)
                progress.tick()
    finally:
        progress.close()
        for engine, _ in engines.values():
            await engine.shutdown()
    return results


def report(results: dict[str, dict[str, list[float]]]) -> None:
    med = {mode: {k: statistics.median(v) for k, v in r.items()} for mode, r in results.items()}
    print(f"{'mode':>6} {'decode tok/s':>13} {'forward ms/step':>16} {'prefill ms':>11}")
    for mode in MODES:
        m = med[mode]
        print(f"{mode:>6} {m['tok_s']:13.1f} {m['fwd_ms']:16.2f} {m['prefill_ms']:11.1f}")
    off, auto = med["off"], med["auto"]
    print(
        f"auto/off: tok/s x{auto['tok_s'] / off['tok_s']:.3f}, decode forward time x{auto['fwd_ms'] / off['fwd_ms']:.3f},"
        f" prefill forward time x{auto['prefill_ms'] / off['prefill_ms']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "config" / "default.yaml"))
    parser.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="forward times as the device thread's CPU time (steadier on a busy machine; use with"
        " --set model.num_threads=1 so that thread does all of the forward's work)",
    )
    args = parser.parse_args()
    import uvloop

    report(uvloop.run(run(args)))


if __name__ == "__main__":
    main()
