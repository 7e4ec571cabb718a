"""Deterministic mode's cost, side by side in one run (issue 27): the default config against
`deterministic: true` on the throughput workload (benchmarks/throughput.py, the packaged
model), alternating `--rounds` times, each run in its own process; then the ratio of the
median output tok/s (target >= 0.75x). The hybrid side (cold and hit TTFT per state
strategy, with and without deterministic mode) is benchmarks/hybrid_prefix.py.

    .venv/bin/python benchmarks/deterministic.py                       # 48 requests, 2 rounds
    .venv/bin/python benchmarks/deterministic.py --num-requests 24 --output-max 64 --rounds 1
    .venv/bin/python benchmarks/deterministic.py --features --num-requests 24 --output-max 64  # cost per feature
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# `--features`: deterministic mode's cost with each feature on (README "Deterministic mode"):
# name -> the benchmarks/throughput.py arguments that turn it on, beside the default config's.
FEATURES: dict[str, tuple[str, ...]] = {
    "default config": (),
    "float32, no quantization": ("--set", "model.dtype=float32", "--set", "model.quantization=none"),
    "host + file storage tiers": ("--set", "hicache.host_ratio=1", "--set", "hicache.storage=file"),
    "speculative ngram": ("--set", "speculative.method=ngram"),
    "overlap scheduling on": ("--set", "scheduler.overlap=on"),
    "graphs off (eager decode steps)": ("--set", "graphs.mode=off"),
    "structured outputs (regex)": ("--regex", "[a-z ]+"),
}
# Tensor parallelism is not a row: the packaged model's 9 attention heads do not split over
# ranks (its deterministic hits are checked `==` at tp_size 2 in tests/test_tensor_parallel*.py).


def output_tok_per_s(deterministic: bool, args: argparse.Namespace, json_path: Path,
                     extra: tuple[str, ...] = ()) -> float:
    cmd = [sys.executable, "benchmarks/throughput.py", "--skip-baseline", "--num-requests", str(args.num_requests),
           "--output-max", str(args.output_max), "--json", str(json_path),
           "--set", f"deterministic={str(deterministic).lower()}", *extra]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return float(json.loads(json_path.read_text())["systems"]["tierserve"]["output_tok_per_s"])


def feature_table(args: argparse.Namespace, tmp: Path) -> None:
    """Default vs deterministic with each feature of FEATURES on, one pair at a time."""
    storage = tmp / "kv"
    rows = []
    for name, settings in FEATURES.items():
        pair = []
        for det in (False, True):
            extra = (*settings, "--set", f"hicache.storage_dir={storage / f'{name}-{det}'}")
            pair.append(output_tok_per_s(det, args, tmp / "feature.json", extra))
        rows.append((name, *pair))
        print(f"{name}: default {pair[0]:.1f}, deterministic {pair[1]:.1f} output tok/s", flush=True)
    print("\n| feature | default tok/s | deterministic tok/s | deterministic / default |\n|---|---|---|---|")
    for name, default, det in rows:
        print(f"| {name} | {default:.1f} | {det:.1f} | {det / default:.2f}x |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--output-max", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--features", action="store_true", help="one default/deterministic pair per feature instead")
    args = p.parse_args()
    runs: dict[bool, list[float]] = {False: [], True: []}
    if args.features:
        with tempfile.TemporaryDirectory() as tmp:
            feature_table(args, Path(tmp))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for det in (False, True):
                tok_s = output_tok_per_s(det, args, Path(tmp) / f"{r}-{det}.json")
                runs[det].append(tok_s)
                print(f"round {r + 1}: {'deterministic' if det else 'default':>13} {tok_s:8.1f} output tok/s", flush=True)
    default, det = statistics.median(runs[False]), statistics.median(runs[True])
    print(f"\ndeterministic / default output tok/s: {det:.1f} / {default:.1f} = {det / default:.2f}x (target >= 0.75x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
