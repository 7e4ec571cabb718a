"""Where a step's time goes: model forward vs the Python around it.

Runs the engine (packaged SmolLM2, the default config) on two workloads and splits
every step's time into spans measured with `time.perf_counter` (or, with `--cpu-time`, each
thread's CPU time, which other processes on a busy machine disturb far less; use it with
`--set model.num_threads=1` so the device thread does all of the forward's work itself):

- decode-heavy: `--decode-requests` requests with short prompts, all decoding together;
- prefill-heavy: `--prefill-requests` long prompts with a few output tokens each.

Spans, in ms per step (event loop side: plan, batch, apply, emit, loop rest = wall minus
the loop's spans and the await for the device; hand-off = that await minus the
device-thread call: queueing the job and waking both threads; device thread side:
metadata = input tensors + attention metadata, forward = the model (all layers and the LM
head; under `graphs.mode: cpu` a decode step's native call), sample, device rest = the
device-thread call minus those):

    .venv/bin/python benchmarks/step_profile.py
    .venv/bin/python benchmarks/step_profile.py --compare /work/main   # that tree vs this one, interleaved

`--compare TREE` runs each workload in a subprocess per tree (TREE first, then this
repo, `--rounds` times alternately) so both see the same machine load, and prints the
tables side by side with the ratio of step times.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LOOP_SPANS = ("plan", "batch", "apply", "emit")
DEVICE_SPANS = ("metadata", "forward", "sample")
ROWS = (*LOOP_SPANS, "loop rest", "hand-off", *DEVICE_SPANS, "device rest", "step wall")


class Spans:
    """Accumulated seconds per span name, on `clock` (wall, or the calling thread's CPU time)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.clock = clock

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += self.clock() - t0

        return timed


def instrument(engine: Any, spans: Spans) -> None:
    """Wrap the engine's per-step functions (instance attributes, so nothing global changes
    but the step loop module's batch builder, which the loop calls by name)."""
    from kernel.scheduling import step_loop

    loop, runner = engine.loop, engine.parts.runner
    loop.plan = spans.wrap("plan", loop.plan)
    loop.apply = spans.wrap("apply", loop.apply)
    loop.output.emit = spans.wrap("emit", loop.output.emit)
    step_loop.build_forward_batch = spans.wrap("batch", step_loop.build_forward_batch)
    runner.run = spans.wrap("device", runner.run)
    runner.prepare = spans.wrap("metadata", runner.prepare)
    runner.attention.prepare = spans.wrap("metadata", runner.attention.prepare)
    runner.model.forward = spans.wrap("forward", runner.model.forward)
    decoder = getattr(runner.graphs, "decoder", None)  # graphs.mode cpu: the native decode step is the forward
    if decoder is not None:
        decoder.step = spans.wrap("forward", decoder.step)
    runner.sample = spans.wrap("sample", runner.sample)
    await_step = loop.await_step

    async def awaited(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await await_step(*args)
        finally:
            spans.total["await"] += time.perf_counter() - t0

    loop.await_step = awaited


def workload(kind: str, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    if kind == "decode":
        n, lens, out = args.decode_requests, (100, 300), args.decode_tokens
    else:
        n, lens, out = args.prefill_requests, (args.prefill_len, args.prefill_len), 2
    return [([rng.randint(100, 49000) for _ in range(rng.randint(*lens))], out) for _ in range(n)]


async def measured_run(engine: Any, kind: str, args: argparse.Namespace, spans: Spans) -> dict[str, Any]:
    """Run the workload; returns where the measured part started (time, step count, spans).
    Decode-heavy: the measured part starts once every request has its first token, so
    every measured step is all decodes. Prefill-heavy: all of it."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    rids = [engine.add_request(p, {**greedy, "max_new_tokens": n}) for p, n in workload(kind, args)]
    mark: dict[str, Any] = {}
    left = [len(rids)]

    def start() -> None:
        mark.update(t0=time.perf_counter(), steps=engine.loop.steps, spans=dict(spans.total))

    async def consume(rid: str) -> None:
        first = True
        async for chunk in engine.stream(rid):
            if first and chunk.token_ids:
                first, left[0] = False, left[0] - 1
                if left[0] == 0 and kind == "decode":
                    start()

    if kind == "prefill":
        start()
    await asyncio.gather(*(consume(r) for r in rids))
    return mark


def per_step(total: dict[str, float], wall: float, steps: int, cpu_time: bool) -> dict[str, float]:
    """ms per step of every row of the table."""
    ms = {name: total[name] / steps * 1e3 for name in (*LOOP_SPANS, *DEVICE_SPANS)}
    # On CPU time the loop's await is not comparable with wall time: no "loop rest" then.
    rest = wall - sum(total[n] for n in LOOP_SPANS) - total["await"]
    ms["loop rest"] = float("nan") if cpu_time else rest / steps * 1e3
    ms["device rest"] = (total["device"] - sum(total[n] for n in DEVICE_SPANS)) / steps * 1e3
    # The loop's await beyond the device-thread call: queueing the job and waking both threads.
    ms["hand-off"] = float("nan") if cpu_time else (total["await"] - total["device"]) / steps * 1e3
    return ms | {"step wall": wall / steps * 1e3, "steps": steps, "wall s": wall}


async def profile(kind: str, args: argparse.Namespace) -> dict[str, float]:
    from kernel.async_engine import AsyncEngine
    from kernel.config import load_config, parse_set_args

    config = load_config(REPO / "config/default.yaml", parse_set_args(args.set))
    engine = await AsyncEngine.create(config)
    try:
        warm = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        await engine.generate(list(range(1000, 1064)), warm)  # warm-up, not timed
        spans = Spans(time.thread_time if args.cpu_time else time.perf_counter)
        instrument(engine, spans)
        mark = await measured_run(engine, kind, args, spans)
        wall = time.perf_counter() - mark["t0"]
        steps = engine.loop.steps - mark["steps"]
    finally:
        await engine.shutdown()
    total = {name: spans.total[name] - mark["spans"].get(name, 0.0) for name in spans.total}
    return per_step(defaultdict(float, total), wall, steps, args.cpu_time)


def child(args: argparse.Namespace) -> None:
    import uvloop

    print(json.dumps(uvloop.run(profile(args.child, args))))


def run_tree(tree: Path, kind: str, argv: list[str]) -> dict[str, float]:
    """This script, run with `tree`'s packages first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--tree", str(tree), *argv]
    out = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def average(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


def table(kind: str, results: dict[str, dict[str, float]]) -> str:
    names = list(results)
    lines = [f"{kind}: ms per step", "span".ljust(12) + "".join(n[-22:].rjust(24) for n in names)]
    if len(names) == 2:
        lines[1] += "ratio".rjust(8)
    for row in (*ROWS, "steps", "wall s"):
        vals = [results[n][row] for n in names]
        line = row.ljust(12) + "".join(f"{v:24.2f}" for v in vals)
        if len(vals) == 2 and vals[0] > 0:
            line += f"{vals[1] / vals[0]:8.2f}"
        lines.append(line)
    return "\n".join(lines)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode-requests", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-requests", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="runs per tree and workload (--compare)")
    p.add_argument("--compare", type=Path, metavar="TREE", help="another checkout to run first")
    p.add_argument("--only", choices=("decode", "prefill"), help="one workload")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--cpu-time", action="store_true", help="spans in thread CPU time (see above)")
    p.add_argument("--child", choices=("decode", "prefill"), help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    args = p.parse_args()
    passed = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k in ("decode_requests", "decode_tokens", "prefill_requests", "prefill_len", "seed")
    ]
    passed += ["--cpu-time"] if args.cpu_time else []
    passed += [f"--set={s}" for s in args.set]
    return args, passed


def main() -> None:
    args, passed = parse_args()
    if args.child:
        child(args)
        return
    trees = [args.compare.resolve(), REPO] if args.compare else [REPO]
    for kind in [args.only] if args.only else ["decode", "prefill"]:
        runs: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
        for i in range(args.rounds):
            for tree in trees:
                print(f"{kind} round {i + 1}/{args.rounds}: {tree}", file=sys.stderr, flush=True)
                runs[tree].append(run_tree(tree, kind, passed))
        print(table(kind, {str(t): average(r) for t, r in runs.items()}) + "\n", flush=True)


if __name__ == "__main__":
    if "--tree" in sys.argv:  # a child: the tree under test comes before this repo
        sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1])
    else:
        sys.path.insert(0, str(REPO))
    main()
