"""Tensor parallelism's cost on CPU (issue 25), side by side in one invocation: tp_size 1 on
all of this process's cores against tp_size N with the cores shared out (each rank its
share, `parallel.cpus_per_rank` 0), the same workload, alternating `--rounds` times.

Prints each layout's output tok/s and mean step time, the ratio against tp_size 1, and
what the collectives cost rank 0: bytes all-reduced per token per layer (o_proj and
down_proj outputs, and the embedding's one all-reduce a token; the logits gather is listed apart)
and the share of the run spent inside collectives (waiting for the slowest rank included).
On a 2-core VM expect <= 1x: the point is the measured overhead, not a speed-up.

The model: a random Llama with SmolLM2's vocabulary (`--hidden`, `--layers`, 8 heads over 4
KV heads, so it splits 2, 4 or 8 ways), default numerics of this CPU.

    .venv/bin/python benchmarks/tp.py                       # tp 1 vs 2, 16 requests, 2 rounds
    .venv/bin/python benchmarks/tp.py --tp 4 --rounds 1 --num-requests 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_layout(path: str, tp: int, args: argparse.Namespace) -> dict[str, float]:
    from kernel import Engine

    engine = Engine(None, {"model.path": path, "parallel.tp_size": tp, "logging.level": "warning",
                           "cache.prefix": "none", "scheduler.max_running_requests": args.num_requests})
    try:
        prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(args.num_requests)]
        params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        engine.generate(prompts[:1], {**params, "max_new_tokens": 4})  # warm-up: kernels, first allocations
        tp_state = getattr(engine.engine.parts.runner.model, "tp", None)
        before = (tp_state.comm_seconds, tp_state.reduced_bytes, tp_state.gathered_bytes) if tp_state else (0, 0, 0)
        steps0 = engine.engine.loop.steps
        start = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - start
        steps = engine.engine.loop.steps - steps0
        tokens = args.num_requests * (args.prompt_len + args.output_len)
        row: dict[str, float] = {"tok_s": args.num_requests * args.output_len / wall, "step_ms": 1e3 * wall / steps}
        if tp_state is not None:
            row["comm_share"] = (tp_state.comm_seconds - before[0]) / wall
            row["reduce_bytes_tok_layer"] = (tp_state.reduced_bytes - before[1]) / tokens / args.layers
            row["gather_bytes_row"] = (tp_state.gathered_bytes - before[2]) / max(1, args.num_requests * args.output_len)
        return row
    finally:
        engine.shutdown()


def main() -> int:
    from tqdm import tqdm

    from tests.tiny_models import build_tiny_chat

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    args = p.parse_args()
    shape = {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
             "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 4096}
    runs: dict[int, list[dict[str, float]]] = {1: [], args.tp: []}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_chat(Path(tmp) / "llama", shape=shape))
        for _ in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
            for tp, rows in runs.items():
                rows.append(run_layout(path, tp, args))
    print(f"random Llama hidden {args.hidden}, {args.layers} layers, 8 heads / 4 KV heads; {args.num_requests} "
          f"requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, median of {args.rounds} rounds")
    print("layout     | out tok/s | step ms | vs tp 1 | in collectives | all-reduce B/token/layer | gather B/row")
    base = statistics.median(r["tok_s"] for r in runs[1])
    for tp, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        extra: Any = ("", "", "")
        if "comm_share" in med:
            extra = (f"{100 * med['comm_share']:.0f} %", f"{med['reduce_bytes_tok_layer']:.0f}",
                     f"{med['gather_bytes_row']:.0f}")
        print(f"tp_size {tp:<2} | {med['tok_s']:9.1f} | {med['step_ms']:7.1f} | {med['tok_s'] / base:6.2f}x | "
              f"{extra[0]:>14} | {extra[1]:>24} | {extra[2]:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
