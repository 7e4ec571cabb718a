"""The online audit: a running server checking its own cache hits against cold runs.

`audit.sample_rate` of the requests are drawn when they arrive; those that finished (stop
or length) with a cache hit are queued (at most `audit.queue`; more are dropped and
counted) with what they served: tokens, their logprobs (a drawn request computes them
whether or not its client asked: a stale hit often moves logprobs long before a greedy
token), the tier the deepest part of their hit came from. One replay at a time runs when no live request waits: the same prompt, sampling
parameters and seed, as an audit request (`Request.audit`: no prefix match, no insert,
no storage probe; admitted after and retracted before every live request). Then:

- deterministic mode: the replay must equal what was served, bit for bit (invariant 7
  promises it; `==` on tokens and logprobs);
- otherwise the two runs may part at a near tie (batch composition changes the last
  bits), so only the positions before the first differing token are compared, each
  logprob within `audit.tolerance` ("diverged" counts the runs that parted).

A mismatch is counted per tier, kept as `last_mismatch` (/server_info, the admin page)
and logged with both outputs at the first divergence. The server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import structlog

from kernel.config import AuditConfig
from kernel.request import Request
from kernel.sampling_params import SamplingParams

log = structlog.get_logger("tierserve")

TIERS = ("device", "host", "storage")
AUDITED_REASONS = ("stop", "length")
POLL_S = 0.02  # how often a replay looks for a moment when no live request waits


class Served(NamedTuple):
    """What a request served, kept for its replay."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams  # its own, with its seed made explicit
    namespace: str | None
    tier: str  # the deepest tier its hit came from
    output_ids: list[int]
    logprobs: list[float] | None  # served() always keeps them (a drawn request computes them); None: tokens only


class Replayed(NamedTuple):
    output_ids: list[int]
    logprobs: list[float]


class Verdict(NamedTuple):
    mismatch: bool
    diverged: bool  # the runs chose different tokens somewhere (outside deterministic mode: allowed)
    first: int | None  # the first position where tokens or (compared) logprobs differ


def deepest_tier(cached_by_tier: dict[str, int]) -> str:
    return next((t for t in reversed(TIERS) if cached_by_tier.get(t, 0) > 0), "device")


def served(req: Request) -> Served:
    p = req.params
    return Served(
        rid=req.rid, prompt_ids=list(req.prompt_ids), params=dataclasses.replace(p, seed=req.seed),
        namespace=req.namespace, tier=deepest_tier(req.cached_by_tier), output_ids=list(req.output_ids),
        logprobs=list(req.output_logprobs),  # a drawn request computed them (Request.audit_logprobs)
    )


def compare(before: Served, after: Replayed, bitwise: bool, tolerance: float) -> Verdict:
    """The verdict on one replay (see the module docstring for the rule)."""
    a, b = before.output_ids, after.output_ids
    parted = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if parted is None and len(a) != len(b):
        parted = min(len(a), len(b))
    first_lp = None
    if before.logprobs is not None:
        upto = len(a) if parted is None else parted
        if bitwise:
            first_lp = next((i for i in range(upto) if before.logprobs[i] != after.logprobs[i]), None)
        else:
            first_lp = next((i for i in range(upto) if abs(before.logprobs[i] - after.logprobs[i]) > tolerance),
                            None)
    firsts = [i for i in (parted, first_lp) if i is not None]
    first = min(firsts) if firsts else None
    mismatch = first_lp is not None or (bitwise and parted is not None)
    return Verdict(mismatch, parted is not None, first)


def around(values: Sequence[Any] | None, i: int | None, width: int = 3) -> list[Any] | None:
    if values is None or i is None:
        return None
    return list(values[max(0, i - width) : i + width + 1])


class Auditor:
    """Owned by the AsyncEngine, on its event loop. `replay(served)` runs a cold replay
    and returns its output; `live_waiting()` says whether a live request waits."""

    def __init__(self, config: AuditConfig, bitwise: bool, replay: Callable[[Served], Awaitable[Replayed]],
                 live_waiting: Callable[[], bool]) -> None:
        self.config = config
        self.bitwise = bitwise
        self._replay = replay
        self._live_waiting = live_waiting
        self._rng = random.Random(config.seed)
        self._queue: asyncio.Queue[Served] = asyncio.Queue(maxsize=config.queue)
        self.checked: Counter[str] = Counter()
        self.mismatched: Counter[str] = Counter()
        self.diverged = 0
        self.dropped = 0
        self.errors = 0
        self.running = False  # a replay in flight
        self.last_mismatch: dict[str, Any] | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    def draw(self) -> bool:
        """A request arrives: whether it is in the sample (its logprobs are then kept)."""
        return self._rng.random() < self.config.sample_rate

    def offer(self, req: Request) -> None:
        """A request just finished: queue its replay if it was drawn and hit the cache
        (cheap: the loop is calling)."""
        if req.audit or not req.audit_logprobs or not req.cached_tokens or req.finish_reason not in AUDITED_REASONS:
            return
        try:
            self._queue.put_nowait(served(req))
        except asyncio.QueueFull:
            self.dropped += 1

    def pending(self) -> int:
        """Replays queued or running."""
        return self._queue.qsize() + int(self.running)

    async def _run(self) -> None:
        while True:
            job = await self._queue.get()
            while self._live_waiting():
                await asyncio.sleep(POLL_S)
            self.running = True
            try:
                after = await self._replay(job)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed replay is counted, never fatal
                self.errors += 1
                log.warning("audit_replay_failed", rid=job.rid, error=str(exc))
            else:
                self.judge(job, after)
            finally:
                self.running = False

    def judge(self, job: Served, after: Replayed) -> Verdict:
        verdict = compare(job, after, self.bitwise, self.config.tolerance)
        self.checked[job.tier] += 1
        self.diverged += verdict.diverged
        if verdict.mismatch:
            self.mismatched[job.tier] += 1
            i = verdict.first
            self.last_mismatch = {
                "rid": job.rid, "tier": job.tier, "first_divergence": i,
                "served_tokens": around(job.output_ids, i), "replay_tokens": around(after.output_ids, i),
                "served_logprobs": around(job.logprobs, i),
                "replay_logprobs": around(after.logprobs, i) if job.logprobs is not None else None,
            }
            log.error("audit_mismatch", **self.last_mismatch)
        return verdict

    def stats(self) -> dict[str, Any]:
        return {
            "sample_rate": self.config.sample_rate,
            "compare": "bitwise" if self.bitwise else f"logprobs within {self.config.tolerance}",
            "checked": {t: self.checked[t] for t in TIERS},
            "mismatched": {t: self.mismatched[t] for t in TIERS},
            "diverged": self.diverged,
            "dropped": self.dropped,
            "errors": self.errors,
            "pending": self.pending(),
            "last_mismatch": self.last_mismatch,
        }

    def close(self) -> None:
        self._task.cancel()
