"""fp32 vs bf16 vs int8 vs int4: the same workloads on each numerics setting, one run.

Per setting (model.dtype / model.quantization), interleaved in rounds so machine noise
hits all alike: batch-1 decode (one request, a short prompt, `--decode-tokens` greedy
tokens: tok/s after the first token) and the throughput workload of
benchmarks/throughput.py at `--concurrency` requests (output tok/s, mean TTFT). Prints each
setting's best round and its ratio to float32, and greedy agreement with float32.

    .venv/bin/python benchmarks/numerics.py                          # 4 settings, 2 rounds
    .venv/bin/python benchmarks/numerics.py --rounds 1 --concurrency 8 --output-max 32
    .venv/bin/python benchmarks/numerics.py --settings float32/none,bfloat16/int4
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.throughput import (
    Request,
    RunResult,
    add_engine_args,
    agreement,
    engine_config,
    make_workload,
    run_engine,
    table,
)

DEFAULT_SETTINGS = "float32/none,bfloat16/none,bfloat16/int8,bfloat16/int4"


def run_setting(args: argparse.Namespace, setting: str, workload: list[Request]) -> RunResult:
    import uvloop

    dtype, quant = setting.split("/")
    ns = argparse.Namespace(**{**vars(args), "set": [*args.set, f"model.dtype={dtype}", f"model.quantization={quant}"]})
    result = uvloop.run(run_engine(workload, engine_config(ns)))
    gc.collect()
    return dataclasses.replace(result, system=setting)


def decode_tok_s(r: RunResult) -> float:
    t = r.timings[0]
    return 1.0 / t.tpot if t.tpot else 0.0


def best(results: list[RunResult], key: Any) -> RunResult:
    return max(results, key=key)


def summarize(runs: dict[str, dict[str, list[RunResult]]]) -> None:
    base = next(iter(runs))
    print("\nbatch-1 decode (best round):")
    ref_dec = decode_tok_s(best(runs[base]["decode"], decode_tok_s))
    for s, r in runs.items():
        tok_s = decode_tok_s(best(r["decode"], decode_tok_s))
        print(f"  {s:<16} {tok_s:7.1f} tok/s   x{tok_s / ref_dec:.2f} vs {base}")
    print("\nconcurrent workload (best round by output tok/s):")
    tput = {s: best(r["load"], lambda x: x.summary()["output_tok_per_s"]) for s, r in runs.items()}
    print(table(list(tput.values())))
    ref = tput[base].summary()
    for s, r in tput.items():
        m = r.summary()
        same, prefix = agreement(tput[base].outputs, r.outputs)
        print(f"  {s:<16} tok/s x{m['output_tok_per_s'] / ref['output_tok_per_s']:.2f}, "
              f"TTFT x{m['ttft_mean_s'] / ref['ttft_mean_s']:.2f} vs {base}; "
              f"greedy: {same}/{len(r.outputs)} identical, {prefix:.1%} mean matching prefix")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help="comma-separated dtype/quantization pairs")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32, help="requests of the throughput workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-min", type=int, default=128)
    p.add_argument("--input-max", type=int, default=512)
    p.add_argument("--output-min", type=int, default=64)
    p.add_argument("--output-max", type=int, default=256)
    add_engine_args(p)
    args = p.parse_args()
    args.num_requests = args.concurrency
    args.output_min = min(args.output_min, args.output_max)
    args.input_min = min(args.input_min, args.input_max)
    return args


def main() -> None:
    args = parse_args()
    settings = args.settings.split(",")
    load = make_workload(args)
    decode = [Request(list(range(1000, 1016)), args.decode_tokens)]
    runs: dict[str, dict[str, list[RunResult]]] = {s: {"decode": [], "load": []} for s in settings}
    for rnd in range(args.rounds):
        for s in settings:
            print(f"round {rnd + 1}/{args.rounds}: {s}", file=sys.stderr, flush=True)
            runs[s]["decode"].append(run_setting(args, s, decode))
            runs[s]["load"].append(run_setting(args, s, load))
    summarize(runs)


if __name__ == "__main__":
    main()
