"""Decode with the native CPU step (`graphs.mode: cpu`) against the torch path, in one process.

    .venv/bin/python benchmarks/cpu_step.py                 # batches 1, 4 and 8, 3 rounds
    .venv/bin/python benchmarks/cpu_step.py --batch 1 --rounds 5 --set model.num_threads=1

One Engine with config/default.yaml (on CPU `auto` picks the native step for it); each
measurement runs the same greedy requests twice, with the step runner detached (the torch
path over the C++ kernels) and attached, alternating within every round so both see the
same machine. A decode step's time is (time of B requests generating `--tokens` tokens -
time of the same B requests generating 1) / (tokens - 1): prefill and request overhead
cancel. Printed: ms per decode step and tokens/s per path, medians over rounds, and the
ratio. Prompts are distinct (no prefix hits: `cache.prefix: none`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/x.py` puts benchmarks/, not the repo, on the path

from kernel import Engine


def step_ms(engine: Engine, batch: int, tokens: int) -> float:
    prompts = [f"Request {i}: tell me a long story about a dragon and a lighthouse." for i in range(batch)]

    def run(n: int) -> float:
        params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        started = time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - started

    run(1)  # warm-up: allocator, kernels' first touch
    return (run(tokens) - run(1)) / (tokens - 1) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, action="append", help="concurrent requests (repeatable); default 1, 4, 8")
    p.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    args = p.parse_args()
    batches = args.batch or [1, 4, 8]
    overrides: dict[str, Any] = {"cache.prefix": "none", "graphs.mode": "cpu"}
    overrides.update(dict(o.split("=", 1) for o in args.set))
    engine = Engine(str(REPO / "config" / "default.yaml"), overrides)
    runner = engine.engine.parts.runner  # type: ignore[attr-defined]
    native = runner.graphs
    times: dict[tuple[int, str], list[float]] = {}
    try:
        with tqdm(total=args.rounds * len(batches) * 2, desc="decode steps timed", unit="run") as bar:
            for _ in range(args.rounds):
                for batch in batches:
                    for label, graphs in (("torch path", None), ("native step", native)):
                        runner.graphs = graphs
                        times.setdefault((batch, label), []).append(step_ms(engine, batch, args.tokens))
                        bar.update()
    finally:
        runner.graphs = native
        engine.shutdown()
    print(f"ms per decode step (median of {args.rounds} rounds; native step up to {native.max_rows} rows)")
    print(f"{'batch':>5} | {'torch path':>10} | {'native step':>11} | {'ratio':>5} | {'native tok/s':>12}")
    for batch in batches:
        torch_ms = statistics.median(times[(batch, "torch path")])
        native_ms = statistics.median(times[(batch, "native step")])
        print(f"{batch:>5} | {torch_ms:>10.2f} | {native_ms:>11.2f} | {torch_ms / native_ms:>5.2f} | "
              f"{batch * 1e3 / native_ms:>12.1f}")


if __name__ == "__main__":
    main()
