"""Greedy sampling's argmax over a vocabulary: torch's reduction (`max(dim=-1)`, the path
with the CPU kernels off) against the C++ op (gpu/kernels/cpu/sampling.cpp), in one
process, rounds interleaved, each a median of µs per call; the ratio is torch / C++.

    .venv/bin/python benchmarks/greedy_argmax.py [--vocab 49152] [--rows 1 8 32] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu.sampling import argmax_rows, native_argmax_ready


def per_call_us(scores: torch.Tensor, native: bool, calls: int) -> float:
    argmax_rows(scores, native)
    started = time.perf_counter()
    for _ in range(calls):
        argmax_rows(scores, native)
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    if not native_argmax_ready(True, torch.device("cpu")):
        sys.exit("the sampling extension does not build here (or TIERSERVE_CPU_KERNELS=off)")
    print(f"threads={torch.get_num_threads()} vocab={args.vocab}")
    print(f"{'rows':>5} {'torch µs':>10} {'C++ µs':>10} {'ratio':>7}")
    for rows in args.rows:
        scores = torch.randn(rows, args.vocab)
        assert torch.equal(argmax_rows(scores, True), argmax_rows(scores))
        torch_us, native_us = [], []
        for _ in range(args.rounds):
            torch_us.append(per_call_us(scores, False, args.calls))
            native_us.append(per_call_us(scores, True, args.calls))
        t, n = statistics.median(torch_us), statistics.median(native_us)
        print(f"{rows:>5} {t:>10.1f} {n:>10.1f} {t / n:>6.1f}x")


if __name__ == "__main__":
    main()
