"""Soak: a real `tierserve serve` on loopback under a long mixed load, then checked idle.

The server runs with the host and file tiers on and a small device pool, so eviction,
host copies, storage writes and prefetches all happen while 20 % of the streaming
clients hang up mid-stream and some non-streaming ones give up (see soak_workload.py).
Afterwards, with the server idle, every one of these must hold (else exit status 1):

- no page held outside the prefix tree, every request-table row and host page free
  again (admin `/admin/stats`), the integrity check clean (`/admin/check`);
- zero 5xx; every request not cancelled on purpose complete (status 200, all its
  `max_tokens` tokens, finish_reason "length");
- every greedy one identical to a reference run: the same requests sent, not streamed,
  to a fresh server without tiers or prefix cache (deterministic mode on both, so the
  batch a request ran in does not change its tokens);
- the server's RSS after the run within `--rss-bound-mib` of its value after warm-up;
- SIGTERM then exits 0.

    .venv/bin/python benchmarks/soak.py                       # 1,000 requests at concurrency 64
    .venv/bin/python benchmarks/soak.py --requests 60 --concurrency 16 --warmup 16   # the test's variant
    .venv/bin/python benchmarks/soak.py --duration-limit 600 --json soak.json

The model defaults to a tiny random Llama with SmolLM2's tokenizer (built in a temp
folder, seconds); `--model` takes any model path the server takes. `--duration-limit`
stops launching new requests after that many seconds (the report says how many ran).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/soak.py`

from benchmarks.serving import Progress
from benchmarks.soak_server import SoakServer
from benchmarks.soak_workload import GENERATE, Job, Mix, Outcome, make_jobs, send

PAGE = 4
REQUEST_TIMEOUT_S = 300.0


@dataclass
class Report:
    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    aborts: int = 0
    server_errors: int = 0
    greedy_compared: int = 0
    leaked_pages: int | None = None
    tiers: dict[str, int] = field(default_factory=dict)  # hit tokens per tier, storage pages written/read
    rss_warm_mib: float = 0.0
    rss_after_mib: float = 0.0
    seconds: float = 0.0
    exit_code: int | None = None
    ttft_p50_s: float | None = None  # streamed requests that got text
    ttft_p99_s: float | None = None
    audit: dict[str, Any] | None = None  # the server's audit stats after the run (--audit-rate)
    violations: list[str] = field(default_factory=list)


def soak_config(args: argparse.Namespace, model: str, storage_dir: Path) -> dict[str, Any]:
    return {
        "model": {"path": model, "num_threads": args.threads},
        "cache": {"prefix": "radix", "page_size": PAGE, "num_pages": args.num_pages},
        "hicache": {"host_pages": args.host_pages, "storage": "file", "storage_dir": str(storage_dir),
                    "storage_timeout_s": 5.0},
        "scheduler": {"chunked_prefill_size": 64, "max_num_batched_tokens": 256, "max_running_requests": 32},
        "server": {"max_queued_requests": 4 * args.concurrency},
        "deterministic": True,
        "audit": {"sample_rate": args.audit_rate},
        "debug": {"check_invariants": args.check_invariants},
        "logging": {"level": "warning"},
    }


def reference_config(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Cold every time: no prefix cache, no tiers, a pool big enough never to retract."""
    return {
        "model": {"path": model, "num_threads": args.threads},
        "cache": {"prefix": "none", "page_size": PAGE, "num_pages": 2048},
        "scheduler": {"chunked_prefill_size": 64, "max_num_batched_tokens": 256, "max_running_requests": 16},
        "deterministic": True,
        "logging": {"level": "warning"},
    }


async def run_jobs(session: aiohttp.ClientSession, url: str, jobs: list[Job], concurrency: int,
                   deadline: float, bar: Progress) -> list[Outcome]:
    """Every job at most `concurrency` at a time; none starts after `deadline` (monotonic)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(job: Job) -> Outcome | None:
        async with sem:
            if time.monotonic() > deadline:
                return None
            out = await send(session, url, job, REQUEST_TIMEOUT_S)
            bar.tick(out.problem() is None)
            return out

    done = await asyncio.gather(*(one(j) for j in jobs))
    bar.close()
    return [o for o in done if o is not None]


async def reference(session: aiohttp.ClientSession, url: str, jobs: list[Job]) -> dict[int, tuple[str, Any]]:
    """(text, output_ids) of each job, not streamed, at a modest concurrency."""
    sem = asyncio.Semaphore(8)

    async def one(job: Job) -> tuple[int, tuple[str, Any]]:
        async with sem, session.post(url + job.route, json=job.body(stream=False)) as resp:
            obj = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"reference run: {resp.status} {obj}")
            if job.route == GENERATE:
                return job.index, (obj["text"], obj["output_ids"])
            return job.index, (obj["choices"][0]["text"], None)

    return dict(await asyncio.gather(*(one(j) for j in jobs)))


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))]


def tally(report: Report, outcomes: list[Outcome]) -> None:
    report.requests = len(outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    report.ttft_p50_s, report.ttft_p99_s = quantile(ttfts, 0.5), quantile(ttfts, 0.99)
    report.disconnects = sum(o.cut and o.job.disconnect_after is not None for o in outcomes)
    report.aborts = sum(o.cut and o.job.abort_after_s is not None for o in outcomes)
    report.server_errors = sum(o.server_error for o in outcomes)
    if report.server_errors:
        report.violations.append(f"{report.server_errors} responses with a 5xx status")
    problems = [(o.job.index, p) for o in outcomes if (p := o.problem()) is not None]
    report.completed = sum(not o.cut and o.problem() is None for o in outcomes)
    if problems:
        report.violations.append(f"{len(problems)} requests did not complete correctly, e.g. {problems[:3]}")


def check_idle(report: Report, stats: dict[str, Any], check: dict[str, Any]) -> None:
    pages, rows, host = stats["pages"], stats["rows"], stats["host"]
    report.leaked_pages = pages["held"]
    if not stats["idle"]:
        report.violations.append(f"server not idle after the run: {stats['requests']}")
    if pages["held"] != 0 or pages["free"] + pages["cached"] != pages["usable"]:
        report.violations.append(f"device pages held outside the tree: {pages}")
    if rows["free"] != rows["usable"]:
        report.violations.append(f"request-table rows leaked: {rows}")
    if host is not None:
        hp = host["host_pages"]
        if hp["copying"] or hp["free"] + hp["cached"] != hp["usable"]:
            report.violations.append(f"host pages leaked: {hp}")
    if not check.get("ok"):
        report.violations.append(f"integrity check: {check}")
    if stats["halt_reason"] is not None:
        report.violations.append(f"engine halted: {stats['halt_reason']}")
    storage = stats["storage"]
    report.tiers = {"device_hit_tokens": stats["cache"]["prefix_hit_tokens"],
                    "host_hit_tokens": host["host_hit_tokens"] if host else 0,
                    "storage_written_pages": storage["written_pages"] if storage else 0,
                    "storage_read_pages": storage["read_pages"] if storage else 0}
    if not (report.tiers["device_hit_tokens"] and report.tiers["storage_written_pages"]):
        report.violations.append(f"the run did not exercise the prefix cache and the file tier: {report.tiers}")
    report.audit = stats.get("audit")
    if report.audit is not None:
        bad = sum(report.audit["mismatched"].values()) + report.audit["errors"]
        if bad or not sum(report.audit["checked"].values()):
            report.violations.append(f"the audit: {report.audit}")


def compare(report: Report, outcomes: list[Outcome], expected: dict[int, tuple[str, Any]]) -> None:
    wrong = []
    for out in outcomes:
        if out.job.index not in expected or out.problem() is not None:
            continue
        text, output_ids = expected[out.job.index]
        report.greedy_compared += 1
        if out.text != text or (output_ids is not None and out.output_ids != output_ids):
            wrong.append(out.job.index)
    if wrong:
        report.violations.append(f"{len(wrong)} greedy outputs differ from the reference run: jobs {wrong[:10]}")


async def soak(args: argparse.Namespace, model: str, folder: Path, server_env: dict[str, str] | None = None) -> Report:
    """server_env: variables for the soaked server's process (a test plants a bug through
    PYTHONPATH; the reference server never gets them)."""
    report = Report()
    mix = Mix()
    jobs = make_jobs(args.requests, args.seed, mix)
    warmup = make_jobs(args.warmup, args.seed + 1_000_003, mix)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        server = SoakServer(soak_config(args, model, folder / "kv"), folder, "soak", server_env)
        try:
            await server.wait_healthy(session)
            await run_jobs(session, server.url, warmup, args.concurrency, float("inf"),
                           Progress("warm-up", max(len(warmup), 1), args.progress))
            await server.wait_settled(session)
            report.rss_warm_mib = server.rss_mib()
            t0 = time.monotonic()
            outcomes = await run_jobs(session, server.url, jobs, args.concurrency, t0 + args.duration_limit,
                                      Progress("soak", len(jobs), args.progress))
            report.seconds = time.monotonic() - t0
            stats = await server.wait_settled(session)
            check_idle(report, stats, await server.get(session, "/admin/check"))
            report.rss_after_mib = server.rss_mib()
        finally:
            report.exit_code = server.stop()
        if report.exit_code != 0:
            report.violations.append(f"SIGTERM: exit status {report.exit_code}")
        tally(report, outcomes)
        if report.rss_after_mib - report.rss_warm_mib > args.rss_bound_mib:
            report.violations.append(f"RSS grew {report.rss_after_mib - report.rss_warm_mib:.0f} MiB "
                                     f"(bound {args.rss_bound_mib} MiB)")
        if args.reference:
            greedy = [o.job for o in outcomes if o.job.greedy and o.problem() is None and not o.cut]
            ref = SoakServer(reference_config(args, model), folder, "reference")
            try:
                await ref.wait_healthy(session)
                compare(report, outcomes, await reference(session, ref.url, greedy))
            finally:
                ref.stop()
    return report


def rss_line(report: Report, bound_mib: float) -> str:
    growth = report.rss_after_mib - report.rss_warm_mib
    return f"{report.rss_warm_mib:.0f} / {report.rss_after_mib:.0f} MiB (+{growth:.0f}, bound {bound_mib:.0f})"


def audit_line(audit: dict[str, Any] | None) -> str:
    if audit is None:
        return "off"
    return (f"checked {audit['checked']}, mismatched {audit['mismatched']}, dropped {audit['dropped']}, "
            f"errors {audit['errors']} (rate {audit['sample_rate']})")


def summary(report: Report, args: argparse.Namespace) -> str:
    rows = [
        ("requests sent", f"{report.requests} of {args.requests} (concurrency {args.concurrency})"),
        ("completed and checked", report.completed),
        ("disconnected mid-stream", report.disconnects),
        ("aborted by the client", report.aborts),
        ("5xx responses", report.server_errors),
        ("greedy compared with reference", report.greedy_compared),
        ("pages leaked", report.leaked_pages),
        ("tier traffic", ", ".join(f"{k} {v}" for k, v in report.tiers.items())),
        ("RSS after warm-up / after run", rss_line(report, args.rss_bound_mib)),
        ("soak duration", f"{report.seconds:.1f} s"),
        ("TTFT p50 / p99 (streamed)", f"{report.ttft_p50_s or 0:.3f} / {report.ttft_p99_s or 0:.3f} s"),
        ("audit", audit_line(report.audit)),
        ("exit status after SIGTERM", report.exit_code),
        ("violations", len(report.violations)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows] + [f"  - {v}" for v in report.violations]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--warmup", type=int, default=64, help="requests before the RSS baseline is read")
    p.add_argument("--duration-limit", type=float, default=1800.0, help="seconds; no request starts later")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--audit-rate", type=float, default=0.0, help="the server's audit.sample_rate (0: off)")
    p.add_argument("--model", default=None, help="model path (default: a tiny random model built now)")
    p.add_argument("--num-pages", type=int, default=192, help=f"device pool, pages of {PAGE} tokens")
    p.add_argument("--host-pages", type=int, default=256, help="host pool: smaller than the working set, so the file tier serves hits too")
    p.add_argument("--threads", type=int, default=1, help="model.num_threads of the servers")
    p.add_argument("--rss-bound-mib", type=float, default=96.0, help="allowed RSS growth after warm-up")
    p.add_argument("--no-check-invariants", dest="check_invariants", action="store_false",
                   help="skip the integrity check after every step (faster)")
    p.add_argument("--no-reference", dest="reference", action="store_false")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--json", type=Path, help="write the report here")
    return p.parse_args(argv)


def tiny_model(folder: Path) -> str:
    from tests.tiny_models import build_tiny_chat

    return str(build_tiny_chat(folder / "model"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tierserve-soak-") as tmp:
        folder = Path(tmp)
        model = args.model or tiny_model(folder)
        report = asyncio.run(soak(args, model, folder))
    print(summary(report, args))
    if args.json:
        args.json.write_text(json.dumps(report.__dict__, indent=2))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
