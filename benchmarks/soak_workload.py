"""The soak's workload and its clients (benchmarks/soak.py drives them).

A job is one request with a behaviour: run to the end, disconnect mid-stream after a
number of chunks, or abort (the client gives up after a delay; the native API has no
abort route, so giving up is closing the connection, which aborts the generation).
Prompts are token ids: a few shared prefixes and a unique tail each, so the radix tree,
the host tier and the file tier all see repeated prefixes, and every request is
distinct (a greedy one has exactly one right answer, the reference run's).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

COMPLETIONS, GENERATE = "/v1/completions", "/generate"
TOKEN_LOW, TOKEN_HIGH = 100, 20000  # ordinary BPE tokens of SmolLM2's vocabulary


@dataclass(frozen=True)
class Job:
    index: int
    route: str  # COMPLETIONS or GENERATE
    prompt: list[int]
    max_tokens: int
    greedy: bool
    stream: bool
    disconnect_after: int | None = None  # streaming: chunks read before hanging up
    abort_after_s: float | None = None  # not streaming: the client gives up after this

    @property
    def cancelled(self) -> bool:
        return self.disconnect_after is not None or self.abort_after_s is not None

    def body(self, stream: bool | None = None) -> dict[str, Any]:
        """The request body (`stream` overrides the job's: the reference run never streams)."""
        stream = self.stream if stream is None else stream
        sampling = {"temperature": 0.0} if self.greedy else {"temperature": 0.8, "top_p": 0.9, "seed": self.index}
        if self.route == GENERATE:
            params = {**sampling, "max_new_tokens": self.max_tokens, "ignore_eos": True}
            return {"input_ids": self.prompt, "sampling_params": params, "stream": stream}
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": stream,
                **sampling}
        if stream:  # the last event carries the usage: completion tokens are counted by the server
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass
class Outcome:
    job: Job
    status: int | None = None  # HTTP status (None: no response, e.g. aborted first)
    text: str = ""
    output_ids: list[int] | None = None  # /generate only
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # a transport error or an error event in the stream
    cut: bool = False  # the client hung up / gave up as planned
    latency_s: float = 0.0
    started: float = 0.0  # time.perf_counter() when it was sent
    ttft_s: float | None = None  # streamed: until the first chunk with text

    @property
    def server_error(self) -> bool:
        return self.status is not None and self.status >= 500

    def problem(self) -> str | None:
        """Why a request that was meant to complete did not complete correctly (None: it did)."""
        if self.job.cancelled and self.cut:
            return None
        if self.status != 200 or self.error is not None:
            return f"status {self.status}, error {self.error}"
        if self.finish_reason != "length" or self.completion_tokens != self.job.max_tokens:
            return f"finish {self.finish_reason} after {self.completion_tokens}/{self.job.max_tokens} tokens"
        return None


@dataclass(frozen=True)
class Mix:
    """What the soak sends: the shares of each kind of request."""

    prefixes: int = 8
    prefix_share: float = 0.75  # requests that start with a shared prefix
    greedy_share: float = 0.6
    stream_share: float = 0.5
    generate_share: float = 0.4  # of the non-streaming ones: /generate, the rest /v1/completions
    disconnect_share: float = 0.2  # of the streaming clients
    abort_share: float = 0.1  # of the non-streaming clients
    max_tokens: tuple[int, int] = (4, 32)
    tail_tokens: tuple[int, int] = (1, 48)
    prefix_tokens: tuple[int, int] = (8, 160)
    long_share: float = 0.05  # prompts with a long tail (up to long_tokens more)
    long_tokens: int = 320


def make_jobs(n: int, seed: int, mix: Mix) -> list[Job]:
    rng = random.Random(seed)
    prefixes = [ids(rng, rng.randint(*mix.prefix_tokens)) for _ in range(mix.prefixes)]
    return [make_job(i, rng, mix, prefixes) for i in range(n)]


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def make_job(index: int, rng: random.Random, mix: Mix, prefixes: list[list[int]]) -> Job:
    head = rng.choice(prefixes) if rng.random() < mix.prefix_share else []
    tail = rng.randint(*mix.tail_tokens) + (rng.randint(0, mix.long_tokens) if rng.random() < mix.long_share else 0)
    max_tokens = rng.randint(*mix.max_tokens)
    stream = rng.random() < mix.stream_share
    route = COMPLETIONS if stream or rng.random() >= mix.generate_share else GENERATE
    disconnect = rng.randint(1, max(1, max_tokens // 2)) if stream and rng.random() < mix.disconnect_share else None
    abort = rng.uniform(0.01, 1.0) if not stream and rng.random() < mix.abort_share else None
    return Job(index, route, head + ids(rng, tail), max_tokens, rng.random() < mix.greedy_share, stream,
               disconnect, abort)


async def send(session: aiohttp.ClientSession, base_url: str, job: Job, timeout_s: float) -> Outcome:
    """Run one job against the server; never raises (problems land in the outcome)."""
    out = Outcome(job)
    t0 = out.started = time.perf_counter()
    try:
        if job.abort_after_s is not None:
            try:
                await asyncio.wait_for(_exchange(session, base_url, job, out), job.abort_after_s)
            except TimeoutError:
                out.cut = True  # gave up: the connection closes, the server aborts the request
        else:
            await asyncio.wait_for(_exchange(session, base_url, job, out), timeout_s)
    except TimeoutError:
        out.error = f"no answer within {timeout_s} s"
    except (aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.latency_s = time.perf_counter() - t0
    return out


async def _exchange(session: aiohttp.ClientSession, base_url: str, job: Job, out: Outcome) -> None:
    async with session.post(base_url + job.route, json=job.body()) as resp:
        out.status = resp.status
        if resp.status != 200:
            out.error = (await resp.text())[:300]
        elif job.stream:
            await _read_stream(resp, job, out)
        else:
            take_whole(job.route, orjson.loads(await resp.read()), out)


async def _read_stream(resp: aiohttp.ClientResponse, job: Job, out: Outcome) -> None:
    """Completions SSE: text deltas, one finish_reason, then [DONE]; hangs up early when told."""
    chunks = 0
    async for line in resp.content:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        event = orjson.loads(line[6:])
        if "error" in event:
            out.error = str(event["error"])
            return
        for choice in event.get("choices", []):
            if out.ttft_s is None and choice.get("text"):
                out.ttft_s = time.perf_counter() - out.started
            out.text += choice.get("text", "")
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
        if event.get("usage"):
            out.completion_tokens = event["usage"]["completion_tokens"]
        chunks += 1
        if job.disconnect_after is not None and chunks >= job.disconnect_after:
            out.cut = True
            resp.close()  # hang up mid-stream: the server must abort and free the request
            return


def take_whole(route: str, obj: dict[str, Any], out: Outcome) -> None:
    if route == GENERATE:
        meta = obj["meta_info"]
        out.text, out.output_ids = obj["text"], list(obj["output_ids"])
        out.completion_tokens = meta["completion_tokens"]
        reason = meta["finish_reason"]
        out.finish_reason = reason.get("type") if isinstance(reason, dict) else reason
        return
    choice = obj["choices"][0]
    out.text, out.finish_reason = choice["text"], choice["finish_reason"]
    out.completion_tokens = obj["usage"]["completion_tokens"]
