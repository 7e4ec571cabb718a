"""Prefix reuse on a hybrid model: TTFT of a prefix hit vs a cold run at a long context,
for every state strategy, with and without deterministic mode, in one invocation.

A tiny random Qwen3.5 (Gated DeltaNet + gated attention) or LFM2 checkpoint is built in a
temporary folder. The workload: a shared prefix of `--context` tokens, then a question of
`--question` tokens. Cold: the cache is flushed, the whole prompt is computed. Hit: the
shared prefix was computed by an earlier request (a different question), so the request
resumes from the cached recurrent state at the deepest checkpoint and computes the rest.
Each measurement is the median of `--repeat` runs. Printed: cold and hit TTFT, the
speedup, the tokens the hit resumed, and — outside deterministic mode — the largest
logprob difference between the cold and the hit run (in deterministic mode it must be 0).

    .venv/bin/python benchmarks/hybrid_prefix.py                      # 4k context, qwen3_5_text
    .venv/bin/python benchmarks/hybrid_prefix.py --family lfm2 --context 1024 --repeat 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.tiny_hybrid builds the model

STRATEGIES = ("no_buffer", "extra_buffer", "extra_buffer_lazy")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("qwen3_5_text", "lfm2"), default="qwen3_5_text")
    p.add_argument("--context", type=int, default=4096, help="shared prefix tokens")
    p.add_argument("--question", type=int, default=32, help="tokens after the shared prefix")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--interval", type=int, default=64, help="cache.state_track_interval")
    p.add_argument("--skip-deterministic", action="store_true")
    return p.parse_args()


def build_model(family: str, folder: Path, positions: int) -> str:
    from tests.tiny_hybrid import build_tiny_lfm2, build_tiny_qwen3_5

    build = build_tiny_qwen3_5 if family == "qwen3_5_text" else build_tiny_lfm2
    return str(build(folder, max_positions=positions))


def progress(label: str, done: int, total: int) -> None:
    filled = done * 30 // total
    end = "\n" if done == total else ""
    print(f"\r{label:<40} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}", end=end, file=sys.stderr,
          flush=True)


def timed(engine: Any, prompt: list[int], params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    out = engine.generate(prompt, {**params, "max_new_tokens": 1})
    ttft = time.perf_counter() - t0
    full = engine.generate(prompt, params) if params["max_new_tokens"] > 1 else out
    return ttft, full


def measure(folder: str, args: argparse.Namespace, strategy: str, deterministic: bool,
            label: str) -> dict[str, Any]:
    from kernel import Engine

    rng = random.Random(0)
    shared = [rng.randrange(3, 384) for _ in range(args.context)]
    questions = [[rng.randrange(3, 384) for _ in range(args.question)] for _ in range(args.repeat + 1)]
    total = args.context + args.question + args.new_tokens
    pages = 3 * (total // 16 + 2)
    engine = Engine(None, {
        "model.path": folder, "deterministic": deterministic, "cache.page_size": 16,
        "cache.num_pages": pages, "cache.state_strategy": strategy,
        "cache.state_track_interval": args.interval, "logging.level": "warning",
    })
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    cold_t, hit_t, diffs, resumed = [], [], [], []
    try:
        engine.generate(questions[0] * 4, params)  # warm-up: first-call costs out of the timings
        for i in range(args.repeat):
            prompt = shared + questions[i + 1]
            engine.flush_cache()
            t, cold = timed(engine, prompt, params)
            cold_t.append(t)
            engine.flush_cache()
            engine.generate(shared + questions[0], {**params, "max_new_tokens": 1})  # warm the prefix
            t, hit = timed(engine, prompt, params)
            hit_t.append(t)
            resumed.append(hit["meta_info"]["cached_tokens"])
            pairs = zip(cold["meta_info"]["output_token_logprobs"], hit["meta_info"]["output_token_logprobs"])
            diffs.append(max(abs(a[0] - b[0]) for a, b in pairs))
            progress(label, i + 1, args.repeat)
    finally:
        engine.shutdown()
    return {"cold": statistics.median(cold_t), "hit": statistics.median(hit_t),
            "resumed": min(resumed), "max_diff": max(diffs)}


def main() -> int:
    args = parse_args()
    modes = [False] if args.skip_deterministic else [False, True]
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(args.family, Path(tmp), args.context + args.question + args.new_tokens + 64)
        rows = []
        for deterministic in modes:
            for strategy in STRATEGIES:
                label = f"{strategy}{' deterministic' if deterministic else ''}"
                rows.append((label, measure(folder, args, strategy, deterministic, label)))
    print(f"\n{args.family}, shared prefix {args.context} tokens + question {args.question}, "
          f"checkpoint every {args.interval}, median of {args.repeat}")
    print(f"{'strategy':<32} | cold TTFT s | hit TTFT s | speedup | resumed tokens | max |Δlogprob|")
    for label, r in rows:
        print(f"{label:<32} | {r['cold']:11.3f} | {r['hit']:10.3f} | {r['cold'] / r['hit']:6.1f}x | "
              f"{r['resumed']:14d} | {r['max_diff']:.2e}")
    if not args.skip_deterministic:
        for strategy in STRATEGIES:
            base = dict(rows)[strategy]
            det = dict(rows)[f"{strategy} deterministic"]
            print(f"deterministic cost ({strategy}): cold TTFT {det['cold'] / base['cold']:.2f}x, "
                  f"hit TTFT {det['hit'] / base['hit']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
