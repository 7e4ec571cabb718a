"""Prompt scoring cost: prefill with prompt logprobs of every token vs plain prefill, same run.

Each round runs the same fresh batch of random prompts (new ids every round, so the
prefix cache never hits) three ways, interleaved: plain prefill (`max_new_tokens: 1`),
scoring (`logprob_start_len: 0`, `max_new_tokens: 0`, what lm-eval's loglikelihood
requests cost), and scoring with the top 5 per position. Printed: prompt tokens/s per
mode (median over rounds) and each mode's time over plain prefill's.

    .venv/bin/python benchmarks/prompt_logprobs.py                       # 4 rounds of 16 x 256 tokens
    .venv/bin/python benchmarks/prompt_logprobs.py --rounds 2 --num-prompts 4 --prompt-len 64   # smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/x.py` puts benchmarks/, not the repo, on the path

MODES: dict[str, dict[str, Any]] = {
    "prefill": {"max_new_tokens": 1, "temperature": 0},
    "score": {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0},
    "score+top5": {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from kernel import Engine

    engine = Engine(str(REPO / "config" / "default.yaml"))
    rng = random.Random(args.seed)
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        with tqdm(total=args.rounds * len(MODES), desc="rounds x modes") as bar:
            for _ in range(args.rounds):
                for mode, params in MODES.items():
                    prompts = [[rng.randint(100, 49000) for _ in range(args.prompt_len)]
                               for _ in range(args.num_prompts)]
                    start = time.perf_counter()
                    engine.generate(prompts, params)
                    seconds[mode].append(time.perf_counter() - start)
                    bar.update()
    finally:
        engine.shutdown()
    tokens = args.num_prompts * args.prompt_len
    base = statistics.median(seconds["prefill"])
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, median of {args.rounds} rounds")
    for mode, times in seconds.items():
        t = statistics.median(times)
        print(f"  {mode:<11} {tokens / t:9.0f} prompt tok/s   {t / base:5.2f}x prefill's time")


if __name__ == "__main__":
    main()
