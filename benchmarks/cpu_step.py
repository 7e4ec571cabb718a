"""Decode with the native CPU step (`graphs.mode: cpu`), one step a call and in decode runs
(`scheduler.decode_steps`), against the torch path, in one process.

    .venv/bin/python benchmarks/cpu_step.py                 # batches 1, 4 and 8, 3 rounds
    .venv/bin/python benchmarks/cpu_step.py --batch 1 --rounds 5 --set model.num_threads=1

One Engine with config/default.yaml (on CPU `auto` picks the native step for it); each
measurement runs the same greedy requests with the step runner detached (the torch path
over the C++ kernels), attached with decode runs off, and attached with them on (where the
config has them), alternating within every round so all see the same machine. A decode step's time is (time of B requests generating `--tokens` tokens -
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
    scheduler = engine.engine.scheduler  # type: ignore[attr-defined]
    native, runs = runner.graphs, scheduler.runs
    # (label, step runner, decode runs): the torch path, one native step a call, then runs.
    paths = [("torch path", None, None), ("native step", native, None)]
    paths += [(f"runs of {runs.steps}", native, runs)] if runs is not None else []
    times: dict[tuple[int, str], list[float]] = {}
    try:
        with tqdm(total=args.rounds * len(batches) * len(paths), desc="decode steps timed", unit="run") as bar:
            for _ in range(args.rounds):
                for batch in batches:
                    for label, graphs, planned in paths:
                        runner.graphs, scheduler.runs = graphs, planned
                        times.setdefault((batch, label), []).append(step_ms(engine, batch, args.tokens))
                        bar.update()
    finally:
        runner.graphs, scheduler.runs = native, runs
        engine.shutdown()
    print(f"ms per decode step (median of {args.rounds} rounds; native step up to {native.max_rows} rows); "
          "ratio: against the torch path")
    print(f"{'batch':>5} | " + " | ".join(f"{label:>11} | {'ratio':>5}" for label, _, _ in paths)
          + f" | {'best tok/s':>10}")
    for batch in batches:
        ms = [statistics.median(times[(batch, label)]) for label, _, _ in paths]
        cells = " | ".join(f"{m:>11.2f} | {ms[0] / m:>5.2f}" for m in ms)
        print(f"{batch:>5} | {cells} | {batch * 1e3 / min(ms):>10.1f}")


if __name__ == "__main__":
    main()
