"""The online audit's cost and verdict, side by side in one run (issue 27).

The soak (benchmarks/soak.py: a real server, deterministic, host and file tiers, a small
device pool, disconnects and aborts) runs with `audit.sample_rate` 0 and with `--rate`,
alternating `--rounds` times on a fresh server each, and reports per run the streamed
requests' TTFT p50 / p99, the audit's checked and mismatched replays per tier, and the
soak's violations; then the ratio of the median p99 TTFTs (audit on / off).

    .venv/bin/python benchmarks/audit.py                        # 1,000 requests, rate 0.05, 2 rounds
    .venv/bin/python benchmarks/audit.py --requests 200 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/audit.py`

from benchmarks.soak import Report, audit_line, soak, tiny_model
from benchmarks.soak import parse_args as soak_args


def run_once(requests: int, concurrency: int, rate: float, model: str, folder: Path) -> Report:
    args = soak_args(["--requests", str(requests), "--concurrency", str(concurrency), "--audit-rate", str(rate),
                      "--no-reference", "--no-check-invariants", "--quiet"])
    return asyncio.run(soak(args, model, folder))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.05, help="audit.sample_rate of the audited runs")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    p99: dict[float, list[float]] = {0.0: [], args.rate: []}
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        for r in range(args.rounds):
            for rate in (0.0, args.rate):
                folder = Path(tmp) / f"run{r}-{rate}"
                folder.mkdir()
                report = run_once(args.requests, args.concurrency, rate, model, folder)
                bad += len(report.violations)
                if report.ttft_p99_s is not None:
                    p99[rate].append(report.ttft_p99_s)
                print(f"round {r + 1} rate {rate}: {report.requests} requests in {report.seconds:.1f} s, "
                      f"TTFT p50 {report.ttft_p50_s or 0:.3f} s p99 {report.ttft_p99_s or 0:.3f} s; "
                      f"audit {audit_line(report.audit)}; violations {report.violations or 0}", flush=True)
    off, on = statistics.median(p99[0.0]), statistics.median(p99[args.rate])
    print(f"\nmedian p99 TTFT: audit off {off:.3f} s, audit at {args.rate} {on:.3f} s -> {on / off:.3f}x "
          f"(target <= 1.05x); soak violations: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
