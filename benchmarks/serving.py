"""Online serving: an open-loop load generator for any OpenAI-compatible server.

Requests arrive on a seeded Poisson schedule (`--request-rate`, `inf` = all at t=0), at
most `--max-concurrency` in flight, each streamed over SSE. Printed per level: completed /
failed, request throughput, output and total tokens/s, TTFT, ITL (gaps between content
chunks; the max is the longest stall any stream saw), TPOT and end-to-end latency.
`--offline-compare` then runs the same prompts through tierserve's engine in-process and
prints the server / offline output tokens/s ratio (the cost of HTTP, SSE and detokenization).

    tierserve serve --set server.port=30000 &
    .venv/bin/python benchmarks/serving.py --sweep 1,8,32,64
    .venv/bin/python benchmarks/serving.py --num-prompts 8 --input-len 64 --output-len 16 --sweep 1,8
    .venv/bin/python benchmarks/serving.py --request-rate 4 --max-concurrency 32 --json out.json
    .venv/bin/python benchmarks/serving.py --sweep 32 --offline-compare --set logging.level=warning

Each level gets its own seeded prompts (keyed by its concurrency), so a server's prefix
cache can never answer one level from another level's prompts. The offline engine must be
configured like the server (`--config`/`--set`), and on a small machine it must not share
the CPUs with a busy server: it runs only after every server level has finished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/serving.py` puts benchmarks/, not the repo, on the path

from benchmarks.throughput import TOKEN_IDS, add_engine_args, engine_config, greedy, percentile, warn_if_busy

T = TypeVar("T")

# Common English words, each one token (with its leading space) for BPE vocabularies like
# SmolLM2's, so a text prompt of n words is close to n tokens.
WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "his", "her", "they", "this", "had", "are", "but", "not", "were", "which", "be",
    "have", "one", "all", "their", "there", "been", "has", "when", "who", "will", "more", "would",
    "if", "out", "so", "up", "what", "about", "into", "than", "them", "can", "only", "other",
    "new", "some", "could", "time", "these", "two", "may", "then", "do", "first", "any", "my",
    "now", "such", "like", "our", "over", "man", "me", "even", "most", "made", "after", "also",
    "did", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way",
    "well", "down", "should", "because", "each", "just", "those", "people",
)


# ---- workload --------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    body: list[int] | str  # token ids or text, as sent
    output_len: int


def spread(n: int, ratio: float, rng: random.Random) -> int:
    """A length uniform in n*(1 +- ratio), at least 1."""
    return rng.randint(max(1, round(n * (1 - ratio))), max(1, round(n * (1 + ratio))))


def make_prompts(args: argparse.Namespace, key: str) -> list[Prompt]:
    # Keyed by level: a level reproduces its prompts whatever else runs in the sweep.
    rng = random.Random(f"{args.seed}:{key}")
    prompts = []
    for _ in range(args.num_prompts):
        n_in = spread(args.input_len, args.range_ratio, rng)
        n_out = spread(args.output_len, args.range_ratio, rng)
        if args.prompt_kind == "tokens":
            body: list[int] | str = [rng.randint(*TOKEN_IDS) for _ in range(n_in)]
        else:
            body = " ".join(rng.choice(WORDS) for _ in range(n_in))
        prompts.append(Prompt(body, n_out))
    return prompts


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds after t0 at which each request arrives: a Poisson process, first at 0."""
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    return times


# ---- one request -----------------------------------------------------------------------


@dataclass
class Record:
    start: float = 0.0  # perf_counter when the request was sent (after the concurrency gate)
    expected: int = 0  # tokens it must produce (ignore_eos); fewer is reported as a short output
    first: float | None = None  # first content chunk
    end: float = 0.0  # end of the stream
    chunks: list[float] = field(default_factory=list)  # arrival of every content chunk
    output_tokens: int = 0
    prompt_tokens: int = 0
    from_usage: bool = False  # token counts came from the server's usage chunk
    error: str | None = None
    text: list[str] = field(default_factory=list)  # the content pieces, as streamed

    @property
    def ok(self) -> bool:
        return self.error is None and self.first is not None

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]

    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.first is None:
            return None
        return (self.chunks[-1] - self.first) / (self.output_tokens - 1)

    def mark_chunk(self, now: float) -> None:
        if self.first is None:
            self.first = now
        self.chunks.append(now)

    @property
    def short(self) -> bool:
        return self.ok and self.output_tokens < self.expected

    def finish(self, now: float) -> None:
        self.end = now
        if not self.from_usage:  # server sent no usage: assume one token per chunk
            self.output_tokens = len(self.chunks)
        if self.error is None and self.first is None:
            self.error = "stream ended without any content"


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    endpoint: str  # completions | chat
    ignore_eos: bool
    headers: dict[str, str]
    sampling: dict[str, Any] = field(default_factory=dict)  # body fields over greedy (temperature, seed)

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url}/{path}"


def payload(target: Target, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": prompt.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **target.sampling,
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.body}]
    else:
        body["prompt"] = prompt.body
    return body


def content(obj: dict[str, Any], endpoint: str) -> str:
    """The text an event carries ("" for none)."""
    choices = obj.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choices[0].get("text") or "")


def take_event(rec: Record, data: bytes, endpoint: str, now: float) -> None:
    obj = orjson.loads(data)
    if err := obj.get("error"):  # an error after the 200 status line arrives in-band
        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
        return
    usage = obj.get("usage")
    if usage:
        rec.output_tokens = usage.get("completion_tokens", 0)
        rec.prompt_tokens = usage.get("prompt_tokens", 0)
        rec.from_usage = True
    if piece := content(obj, endpoint):
        rec.text.append(piece)
        rec.mark_chunk(now)


async def read_sse(resp: aiohttp.ClientResponse, rec: Record, endpoint: str) -> None:
    # Raw `data:` lines, timestamped as each arrives: no client library's buffering in between.
    async for raw in resp.content:
        now = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        take_event(rec, data, endpoint, now)
        if rec.error is not None:
            return


async def send(session: aiohttp.ClientSession, target: Target, prompt: Prompt) -> Record:
    # ignore_eos promises exactly max_tokens; without it an early stop is legitimate.
    rec = Record(start=time.perf_counter(), expected=prompt.output_len if target.ignore_eos else 0)
    try:
        async with session.post(target.url, json=payload(target, prompt), headers=target.headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                await read_sse(resp, rec, target.endpoint)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    rec.finish(time.perf_counter())
    return rec


# ---- servers -----------------------------------------------------------------------------


def signal_name(code: int) -> str:
    """", killed by SIGILL" for a process's exit code -4 (an illegal instruction: AMX or
    AVX-512 code a VM advertises and traps), and so on; "" for a plain exit."""
    if code >= 0:
        return ""
    try:
        return f", killed by {signal.Signals(-code).name}"
    except ValueError:
        return ""


async def wait_healthy(session: aiohttp.ClientSession, base_url: str, exited: Callable[[], int | None],
                       timeout_s: float, poll_s: float) -> str | None:
    """Poll `base_url`/health until it answers 200: None then, else why not ("exited with N"
    while `exited()` gives the process's exit code, or "not healthy after T s")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = exited()
        if code is not None:
            return f"exited with {code}{signal_name(code)}"
        try:
            async with session.get(f"{base_url}/health") as resp:
                if resp.status == 200:
                    return None
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(poll_s)
    return f"not healthy after {timeout_s:.0f} s"


# ---- progress --------------------------------------------------------------------------


class Progress:
    """`label [####....] done/total` on stderr: redrawn in place (at most 10 Hz) on a terminal,
    one line per tenth of the way otherwise, so a log file stays readable."""

    WIDTH = 30

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = sys.stderr.isatty()
        self.done = self.failed = 0
        self.t0 = self.last = time.perf_counter()

    def tick(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += not ok
        now = time.perf_counter()
        if self.due(now):
            self.last = now
            self.draw(now)

    def due(self, now: float) -> bool:
        if self.done == self.total:
            return True
        if self.tty:
            return now - self.last >= 0.1
        return self.done * 10 // self.total != (self.done - 1) * 10 // self.total

    def draw(self, now: float) -> None:
        if not self.enabled:
            return
        filled = self.WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        fail = f", {self.failed} failed" if self.failed else ""
        line = f"{self.label:>12} [{bar}] {self.done}/{self.total}{fail} {now - self.t0:6.1f}s"
        sys.stderr.write(f"\r{line}" if self.tty else f"{line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---- a load level ----------------------------------------------------------------------


@dataclass
class Level:
    label: str
    concurrency: int | None
    records: list[Record]
    duration: float


async def gated(sem: asyncio.Semaphore | None, make: Callable[[], Awaitable[T]]) -> T:
    if sem is None:
        return await make()
    async with sem:
        return await make()


async def open_loop(
    prompts: list[Prompt],
    run_one: Callable[[Prompt], Awaitable[Record]],
    rate: float,
    concurrency: int | None,
    progress: Progress,
    rng: random.Random,
) -> tuple[list[Record], float]:
    """Launch each prompt at its arrival time regardless of earlier ones (open loop)."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(prompt: Prompt) -> Record:
        rec = await gated(sem, lambda: run_one(prompt))
        progress.tick(rec.ok)
        return rec

    t0 = time.perf_counter()
    progress.t0 = t0
    tasks = []
    for prompt, at in zip(prompts, arrival_times(len(prompts), rate, rng)):
        # Absolute schedule: a late wake-up doesn't push every later arrival back.
        if (delay := t0 + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(prompt)))
    records = list(await asyncio.gather(*tasks))
    progress.close()
    return records, max(r.end for r in records) - t0


def level_label(concurrency: int | None) -> str:
    return f"c={concurrency}" if concurrency else "c=inf"


async def run_server_level(
    session: aiohttp.ClientSession, target: Target, args: argparse.Namespace, concurrency: int | None
) -> Level:
    label = level_label(concurrency)
    prompts = make_prompts(args, label)
    progress = Progress(label, len(prompts), not args.no_progress)
    rng = random.Random(f"{args.seed}:{label}:arrivals")
    records, duration = await open_loop(
        prompts, lambda p: send(session, target, p), args.request_rate, concurrency, progress, rng
    )
    return Level(label, concurrency, records, duration)


# ---- metrics ---------------------------------------------------------------------------


# None, not NaN, for "no data": it prints as "-" and stays valid JSON.
def pct(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(level: Level) -> dict[str, Any]:
    ok = [r for r in level.records if r.ok]
    ttft = [r.first - r.start for r in ok if r.first is not None]
    itl = [g for r in ok for g in r.itls()]  # pooled over requests, as a stream sees them
    tpot = [t for r in ok if (t := r.tpot()) is not None]
    e2e = [r.end - r.start for r in ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    d = level.duration
    return {
        "label": level.label, "concurrency": level.concurrency,
        "completed": len(ok), "failed": len(level.records) - len(ok), "duration_s": d,
        "request_throughput": len(ok) / d, "output_tok_per_s": out_tok / d,
        "total_tok_per_s": (in_tok + out_tok) / d, "output_tokens": out_tok, "prompt_tokens": in_tok,
        "ttft_mean_s": mean(ttft), "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
        "ttft_p99_s": pct(ttft, 99),
        "itl_mean_s": mean(itl), "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
        "itl_max_s": max(itl, default=None), "tpot_mean_s": mean(tpot),
        "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "tokens_per_chunk": out_tok / max(sum(len(r.chunks) for r in ok), 1),
        "short_outputs": sum(r.short for r in level.records),
    }


def per_request(level: Level) -> list[dict[str, Any]]:
    """Each request's own numbers, relative to its send time, for the JSON file."""
    rows = []
    for r in level.records:
        itls = r.itls()
        rows.append({
            "ttft_s": None if r.first is None else r.first - r.start, "e2e_s": r.end - r.start,
            "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens, "chunks": len(r.chunks),
            "itl_max_s": max(itls, default=None), "tpot_s": r.tpot(), "error": r.error,
        })
    return rows


# ---- report ----------------------------------------------------------------------------

COLUMNS: tuple[tuple[str, str, float, str], ...] = (
    # (header, summary key, scale, format)
    ("ok", "completed", 1, "d"), ("fail", "failed", 1, "d"), ("dur s", "duration_s", 1, ".1f"),
    ("req/s", "request_throughput", 1, ".2f"), ("out tok/s", "output_tok_per_s", 1, ".1f"),
    ("tot tok/s", "total_tok_per_s", 1, ".1f"),
    ("TTFT mean", "ttft_mean_s", 1e3, ".0f"), ("p50", "ttft_p50_s", 1e3, ".0f"),
    ("p90", "ttft_p90_s", 1e3, ".0f"), ("p99", "ttft_p99_s", 1e3, ".0f"),
    ("ITL mean", "itl_mean_s", 1e3, ".1f"), ("p50", "itl_p50_s", 1e3, ".1f"),
    ("p99", "itl_p99_s", 1e3, ".1f"), ("max", "itl_max_s", 1e3, ".1f"),
    ("TPOT mean", "tpot_mean_s", 1e3, ".1f"), ("E2E p50 s", "e2e_p50_s", 1, ".2f"),
    ("p99", "e2e_p99_s", 1, ".2f"),
)


def cell(value: Any, scale: float, fmt: str) -> str:
    if value is None:
        return "-"
    return format(int(value) if fmt == "d" else value * scale, fmt)


def table(summaries: list[dict[str, Any]]) -> str:
    rows = [("level", *(c[0] for c in COLUMNS))]
    rows += [(s["label"], *(cell(s[k], sc, f) for _, k, sc, f in COLUMNS)) for s in summaries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(TTFT, ITL, TPOT in ms; ITL = gap between content chunks)"


def print_errors(level: Level, limit: int = 3) -> None:
    if short := sum(r.short for r in level.records):
        print(f"  {level.label}: {short} requests stopped before max_tokens (server ignores ignore_eos?)")
    errors = sorted({r.error for r in level.records if r.error})
    for e in errors[:limit]:
        print(f"  {level.label} error: {e}")
    if len(errors) > limit:
        print(f"  {level.label}: {len(errors) - limit} more distinct errors")


# ---- server passes ---------------------------------------------------------------------


async def discover_model(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    async with session.get(f"{base_url}/models", headers=headers) as resp:
        if resp.status != 200:
            raise SystemExit(f"GET {base_url}/models: HTTP {resp.status}; pass --model")
        data = (await resp.json())["data"]
    if not data:
        raise SystemExit(f"{base_url}/models lists no models; pass --model")
    return str(data[0]["id"])


async def warm_up(session: aiohttp.ClientSession, target: Target, args: argparse.Namespace) -> None:
    """One short untimed request: first-request costs (connections, lazy init) stay out of level 1."""
    body: list[int] | str = list(range(1000, 1016)) if args.prompt_kind == "tokens" else "hello " * 16
    rec = await send(session, target, Prompt(body, 4))
    if not rec.ok:
        raise SystemExit(f"warm-up request to {target.url} failed: {rec.error}")


async def server_passes(args: argparse.Namespace) -> tuple[Target, list[Level]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No pool limit (the semaphore is the limit) and no total timeout (long runs are the point).
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=args.read_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = args.model or await discover_model(session, args.base_url, headers)
        target = Target(args.base_url, model, args.endpoint, not args.no_ignore_eos, headers)
        print(f"target: {target.url}, model {model}")
        await warm_up(session, target, args)
        levels = []
        for c in args.levels:
            levels.append(await run_server_level(session, target, args, c))
    return target, levels


# ---- offline engine --------------------------------------------------------------------


def engine_prompt(engine: Any, prompt: Prompt, endpoint: str) -> list[int] | str:
    """What the server would feed its engine for this prompt (chat: the rendered template)."""
    if endpoint != "chat":
        return prompt.body
    messages = [{"role": "user", "content": prompt.body}]
    return list(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)))


async def offline_one(engine: Any, prompt: Prompt, args: argparse.Namespace) -> Record:
    params = greedy(prompt.output_len) | {"ignore_eos": not args.no_ignore_eos}
    rec = Record(start=time.perf_counter(), expected=0 if args.no_ignore_eos else prompt.output_len)
    rid = engine.add_request(engine_prompt(engine, prompt, args.endpoint), params)
    async for chunk in engine.stream(rid):
        # The server sends a chunk only when there is text; count the same chunks here.
        if chunk.text:
            rec.mark_chunk(time.perf_counter())
        rec.output_tokens, rec.prompt_tokens = chunk.completion_tokens, chunk.prompt_tokens
    rec.from_usage = True
    rec.finish(time.perf_counter())
    return rec


async def offline_pass(args: argparse.Namespace, config: Any) -> Level:
    from kernel.async_engine import AsyncEngine

    label = level_label(args.offline_concurrency)
    engine = await AsyncEngine.create(config)
    try:
        await engine.generate(list(range(1000, 1032)), greedy(4))  # warm-up, not timed
        progress = Progress("offline", args.num_prompts, not args.no_progress)
        rng = random.Random(f"{args.seed}:{label}:arrivals")
        records, duration = await open_loop(
            make_prompts(args, label), lambda p: offline_one(engine, p, args),
            args.request_rate, args.offline_concurrency, progress, rng,
        )
    finally:
        await engine.shutdown()
    return Level(f"offline {label}", args.offline_concurrency, records, duration)


def compare(server: list[dict[str, Any]], offline: dict[str, Any], limit: float) -> float | None:
    match = [s for s in server if s["concurrency"] == offline["concurrency"]]
    if not match:
        print(f"\nno server level at concurrency {offline['concurrency']} to compare with the offline pass")
        return None
    ratio = float(match[0]["output_tok_per_s"] / offline["output_tok_per_s"])
    verdict = "within" if ratio >= 1 - limit else "NOT within"
    print(
        f"\nserver / offline output tok/s at {offline['label'].split()[-1]}: "
        f"{match[0]['output_tok_per_s']:.1f} / {offline['output_tok_per_s']:.1f} = {ratio:.3f} "
        f"({verdict} {limit:.0%} of offline)"
    )
    return ratio


# ---- main ------------------------------------------------------------------------------


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # any OpenAI-compatible target: uvloop is only a speed-up for the client
        return asyncio.run(coro)
    return uvloop.run(coro)


def parse_levels(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[int | None]:
    if not args.sweep:
        return [args.max_concurrency]
    try:
        levels = [int(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError:
        p.error(f"--sweep takes comma-separated integers, got {args.sweep!r}")
    if not levels or min(levels) < 1:
        p.error("--sweep levels must be >= 1")
    return list(levels)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    t.add_argument("--model", help="default: the first id GET /models lists")
    t.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    t.add_argument("--no-ignore-eos", action="store_true",
                   help="don't send ignore_eos (servers without it may stop early; short outputs are allowed)")
    t.add_argument("--read-timeout", type=float, default=600, help="seconds a stream may stay silent")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64, help="requests per level")
    w.add_argument("--prompt-kind", choices=("tokens", "text"), default="tokens",
                   help="random token ids (completions only) or random words (~1 token each)")
    w.add_argument("--input-len", type=int, default=256)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)")
    w.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate, req/s (inf: all at once)")
    a.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    a.add_argument("--sweep", help="comma-separated --max-concurrency levels, one table row each")
    o = p.add_argument_group("offline comparison")
    o.add_argument("--offline-compare", action="store_true",
                   help="after the server levels, run the same workload in-process and compare")
    o.add_argument("--offline-concurrency", type=int, default=32)
    add_engine_args(o, " for the offline engine; match the server's config")
    o.add_argument("--tolerance", type=float, default=0.15, help="allowed server shortfall vs offline")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = p.parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    if args.endpoint == "chat" and args.prompt_kind == "tokens":
        p.error("--endpoint chat needs --prompt-kind text (messages are text)")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be >= 1")
    if not 0 <= args.range_ratio < 1 or not args.request_rate > 0:
        p.error("need 0 <= --range-ratio < 1 and --request-rate > 0")
    args.levels = parse_levels(p, args)
    return args


def describe(args: argparse.Namespace) -> None:
    spread_ = f" +- {args.range_ratio:.0%}" if args.range_ratio else ""
    print(
        f"workload: {args.num_prompts} {args.prompt_kind} prompts per level, input {args.input_len}{spread_}, "
        f"output {args.output_len}{spread_}, seed {args.seed}; rate {args.request_rate} req/s; "
        f"levels {', '.join(level_label(c) for c in args.levels)}"
    )
    warn_if_busy()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    describe(args)
    target, levels = run_loop(server_passes(args))
    summaries = [summarize(lv) for lv in levels]
    print(table(summaries))
    for lv in levels:
        print_errors(lv)
    out: dict[str, Any] = {"target": asdict(target) | {"headers": None}, "levels": summaries,
                           "requests": {lv.label: per_request(lv) for lv in levels}}
    if args.offline_compare:
        # Two engines on a 2-core machine would halve each other: the server must be idle now.
        print("\noffline pass: in-process engine (the server must stay idle; it is not used from here on)")
        warn_if_busy(limit=1.0)
        offline = run_loop(offline_pass(args, engine_config(args)))
        out["offline"] = summarize(offline)
        out["requests"][offline.label] = per_request(offline)
        print(table(summaries + [out["offline"]]))
        print_errors(offline)
        out["server_over_offline"] = compare(summaries, out["offline"], args.tolerance)
    if args.json:
        out["args"] = {k: v for k, v in vars(args).items() if k != "api_key"}
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
