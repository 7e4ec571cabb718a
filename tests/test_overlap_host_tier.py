"""Overlap scheduling together with host-tier loads (dense model, deterministic mode): the
deferred-duplicate path of kernel/scheduling/prefix_reuse.py.

Two requests prefill the same prompt side by side; when the second caches its first
chunk, the cache already has those pages, so its own copies are duplicates — but its next
chunk is already in flight (overlap) and maps them through its old table row. Right
then a third request arrives whose prefix is on host only, and its load takes device
pages. The duplicates must wait until that step has landed (`PrefixReuse.deferred`):
a page handed out while a step in flight maps it would be refilled under the step.

The guard watches every page allocation against the pages each step in flight mapped at
submission, and checks that a host load really started while duplicates were deferred,
that the third request hit on host, and that all outputs `==` overlap off (cold runs).
Revert-then-red: duplicates freed at once even when their request is in flight.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cache.prefix_cache import MatchResult
from kernel import Engine
from kernel.request import Request
from kernel.scheduling.prefix_reuse import PrefixReuse
from kernel.tiers.host_tier import HostTier
from tests import leaks
from tests.test_host_tier_hybrid import tiers
from tests.test_overlap import GREEDY, assert_same_outputs, make
from tests.test_tier_combos_hybrid import push_all_to_host

HOSTED = {"hicache.host_pages": 200, "scheduler.share_prefix_min_tokens": 0}
PROMPT = [200 + (7 * j) % 97 for j in range(60)]  # run twice at once: duplicates
ON_HOST = [600 + 3 * j for j in range(24)]  # 6 pages, pushed to host before
LATE = ON_HOST + [901, 902, 903]  # arrives while the duplicates are deferred


class Watch:
    """Pages each step in flight mapped at submission, allocations that handed one out
    again, and host loads started while duplicates were deferred."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ae = engine.engine
        self.mapped: dict[int, set[int]] = {}
        self.reused: list[list[int]] = []
        self.deferred_at_load: list[int] = []
        self.late: list[str] = []  # the late request's id, once added
        self._spy_submit(monkeypatch)
        self._spy_allocate(monkeypatch)
        self._spy_loads(monkeypatch)
        self._add_late_on_duplicates(monkeypatch)

    def _spy_submit(self, mp: pytest.MonkeyPatch) -> None:
        loop = self.ae.loop
        real = loop.submit

        def submit(plan: Any) -> Any:
            step = real(plan)
            if step is not None:  # the rows were written before the step was submitted
                self.mapped[id(step)] = {p for c in plan.chunks for p in c.req.pages}
                step.add_done_callback(lambda f: self.mapped.pop(id(f), None))
            return step

        mp.setattr(loop, "submit", submit)

    def _spy_allocate(self, mp: pytest.MonkeyPatch) -> None:
        allocator = self.ae.scheduler.allocator
        real = allocator.allocate

        def allocate(n: int) -> list[int]:
            pages = real(n)
            reused = set(pages).intersection(*[set().union(*self.mapped.values())])
            if reused:
                self.reused.append(sorted(reused))
            return pages

        mp.setattr(allocator, "allocate", allocate)

    def _spy_loads(self, mp: pytest.MonkeyPatch) -> None:
        real, prefix = HostTier.start_load, self.ae.scheduler.prefix

        def start_load(tier: HostTier, req: Request, match: MatchResult) -> bool:
            if match.host_pages:
                self.deferred_at_load.append(len(prefix.deferred))
            return real(tier, req, match)

        mp.setattr(HostTier, "start_load", start_load)

    def _add_late_on_duplicates(self, mp: pytest.MonkeyPatch) -> None:
        """When a request in flight has just joined the cache's copy of its pages."""
        prefix = self.ae.scheduler.prefix
        real = prefix._insert

        def insert(req: Request, full: int, state_slot: int | None) -> bool:
            mine = list(req.pages[:full])
            took = real(req, full, state_slot)
            if req.inflight and req.pages[:full] != mine and not self.late:
                self.late.append(self.ae.add_request(LATE, GREEDY))
            return took

        mp.setattr(prefix, "_insert", insert)

    async def run(self) -> list[dict[str, Any]]:
        rids = [self.ae.add_request(PROMPT, GREEDY) for _ in range(2)]
        outs = list(await asyncio.gather(*(self.ae.collect(r) for r in rids)))
        assert self.late, "no request joined the cache's copy while its next step was in flight"
        return [*outs, await self.ae.collect(self.late[0])]


def overlap_with_a_load(folder: str, monkeypatch: pytest.MonkeyPatch, planted: bool = False) -> None:
    off = make(folder, "off", **HOSTED)
    try:
        ref = off.generate([PROMPT, PROMPT, LATE], GREEDY)
    finally:
        off.shutdown()
    on = make(folder, "on", **HOSTED)
    try:
        on.generate(ON_HOST, GREEDY)
        assert push_all_to_host(on) > 0
        watch = Watch(on, monkeypatch)
        got = on._call(watch.run())
        assert not watch.reused, f"a page was handed out again while a step in flight mapped it: {watch.reused}"
        assert any(watch.deferred_at_load), f"no host load while duplicates waited: {watch.deferred_at_load}"
        assert tiers(got[2])["host"] == len(ON_HOST), tiers(got[2])
        assert_same_outputs(got, ref)  # type: ignore[arg-type]
    finally:
        if planted:
            leaks.excuse(on.engine)
        on.shutdown()


def test_duplicates_wait_for_their_step_while_a_host_load_runs(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    overlap_with_a_load(tiny_chat_folder, monkeypatch)


def test_red_duplicates_freed_while_their_step_runs(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = PrefixReuse._insert

    def at_once(self: PrefixReuse, req: Request, full: int, state_slot: int | None) -> bool:
        inflight, req.inflight = req.inflight, 0  # planted: the step in flight forgotten
        try:
            return real(self, req, full, state_slot)
        finally:
            req.inflight = inflight

    monkeypatch.setattr(PrefixReuse, "_insert", at_once)
    with pytest.raises(AssertionError, match="handed out again while a step in flight mapped it"):
        overlap_with_a_load(tiny_chat_folder, monkeypatch, planted=True)
