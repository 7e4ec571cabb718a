"""Structured outputs: what a JSON schema costs, on the async engine in-process.

The same prompts (tests/structured_cases.py: 20 bounded schemas, cycled to
`--num-prompts`) at concurrency `--concurrency`, with and without their schema. An
untimed warm-up run with the schemas fixes each prompt's output length; the plain runs
generate exactly as many tokens (ignore_eos), which makes tokens/s comparable. Rounds
alternate which run goes first to spread the machine's noise over both. Printed: output tokens/s, TTFT mean / p99, and
the grammar's own time per constrained token (mask fill + mask application on the
device thread, matcher advance on the loop), timed by wrapping those three functions.

    .venv/bin/python benchmarks/structured.py
    .venv/bin/python benchmarks/structured.py --num-prompts 32 --rounds 3 --set model.num_threads=2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.serving import Progress
from benchmarks.throughput import add_engine_args, engine_config, percentile, warn_if_busy
from tests.structured_cases import CASES, MAX_TOKENS


@dataclass
class GrammarClock:
    """Seconds spent in each of the grammar's functions, summed over threads."""

    parts: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0
        return timed


def instrument(clock: GrammarClock) -> None:
    import gpu.sampling
    import kernel.scheduling.scheduler

    gpu.sampling.build_token_mask = clock.wrap("fill", gpu.sampling.build_token_mask)
    gpu.sampling.apply_token_mask = clock.wrap("apply", gpu.sampling.apply_token_mask)
    kernel.scheduling.scheduler.advance_grammar = clock.wrap("advance", kernel.scheduling.scheduler.advance_grammar)


@dataclass
class RunResult:
    wall_s: float
    tokens: list[int]
    ttft_s: list[float]
    grammar_s: float
    invalid: int

    @property
    def tok_s(self) -> float:
        return sum(self.tokens) / self.wall_s


async def one(engine: Any, prompt: str, params: dict[str, Any], gate: asyncio.Semaphore,
              progress: Progress) -> tuple[float, str, int]:
    async with gate:
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, params)
        first, text, tokens = None, "", 0
        async for chunk in engine.stream(rid):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            text += chunk.text
            tokens = chunk.completion_tokens
    progress.tick()
    return first or 0.0, text, tokens


async def run(engine: Any, prompts: list[tuple[str, dict[str, Any]]], lengths: list[int] | None,
              args: argparse.Namespace, clock: GrammarClock, progress: Progress) -> RunResult:
    """With lengths None: each prompt with its schema; else plain, exactly lengths[i] tokens."""
    gate = asyncio.Semaphore(args.concurrency)
    jobs = []
    for i, (prompt, schema) in enumerate(prompts):
        if lengths is None:
            params = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "json_schema": json.dumps(schema)}
        else:
            params = {"temperature": 0, "max_new_tokens": max(lengths[i], 1), "ignore_eos": True}
        jobs.append(one(engine, prompt, params, gate, progress))
    ok, why = engine.flush_cache()  # no run reuses another's prompts from the prefix cache
    assert ok, why
    before, t0 = clock.seconds, time.perf_counter()
    outs = await asyncio.gather(*jobs)
    wall = time.perf_counter() - t0
    invalid = sum(1 for _, text, _ in outs if lengths is None and not _parses(text))
    return RunResult(wall, [n for *_, n in outs], [t for t, *_ in outs], clock.seconds - before, invalid)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def report(plain: list[RunResult], schema: list[RunResult], clock: GrammarClock) -> None:
    def row(name: str, runs: list[RunResult]) -> tuple[float, float, float, float]:
        tok_s = statistics.median(r.tok_s for r in runs)
        ttfts = [t for r in runs for t in r.ttft_s]
        tokens = sum(sum(r.tokens) for r in runs)
        per_token_ms = 1e3 * sum(r.grammar_s for r in runs) / max(tokens, 1)
        print(f"{name:<8} {tok_s:>10.1f} {1e3 * statistics.mean(ttfts):>14.1f} {1e3 * percentile(ttfts, 99):>13.1f} "
              f"{per_token_ms:>17.3f}")
        return tok_s, statistics.mean(ttfts), percentile(ttfts, 99), per_token_ms

    print(f"{'run':<8} {'output tok/s':>10} {'TTFT mean ms':>14} {'TTFT p99 ms':>13} {'grammar ms/token':>17}")
    p = row("plain", plain)
    s = row("schema", schema)
    print(f"{'ratio':<8} {s[0] / p[0]:>10.3f} {s[1] / p[1]:>14.3f} {s[2] / p[2]:>13.3f} {'':>17}")
    print(f"invalid JSON replies: {sum(r.invalid for r in schema)} of {sum(len(r.tokens) for r in schema)}")
    tokens = max(sum(sum(r.tokens) for r in schema), 1)
    print("grammar ms/token by part (schema runs): "
          + ", ".join(f"{name} {1e3 * sec / tokens:.3f}" for name, sec in sorted(clock.parts.items())))


async def main_async(args: argparse.Namespace) -> None:
    from kernel.async_engine import AsyncEngine
    from kernel.sampling_params import SamplingParams

    clock = GrammarClock()
    instrument(clock)
    engine = await AsyncEngine.create(engine_config(args))
    prompts = [CASES[i % len(CASES)] for i in range(args.num_prompts)]
    try:
        # Compiled outside the timed runs (the grammar cache keeps them).
        await engine.prepare_grammars([SamplingParams(json_schema=json.dumps(s)) for _, s in CASES])
        progress = Progress("structured", (2 * args.rounds + 1) * len(prompts), enabled=True)
        # Untimed warm-up (first forwards at these shapes are slow); it also fixes each
        # prompt's output length, which the plain runs then generate exactly.
        lengths = (await run(engine, prompts, None, args, clock, progress)).tokens
        clock.parts.clear()
        plain: list[RunResult] = []
        schema: list[RunResult] = []
        for r in range(args.rounds):  # alternate which goes first
            for constrained in ((True, False) if r % 2 else (False, True)):
                runs = schema if constrained else plain
                runs.append(await run(engine, prompts, None if constrained else lengths, args, clock, progress))
    finally:
        await engine.shutdown()
    report(plain, schema, clock)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    add_engine_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warn_if_busy()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
