"""Scheduler planning on plain state: budgets, alignment, retraction, accounting."""

from __future__ import annotations

import random

import pytest
import torch

from cache.allocator import PageAllocator
from cache.prefix_cache import NoPrefixCache, PrefixCache
from cache.radix_tree import RadixTree
from cache.req_table import ReqToTokenTable
from gpu.forward_batch import SampledToken
from handlers.evict_lru import LRU
from handlers.fcfs import FCFS
from kernel.config import SchedulerConfig
from kernel.request import Request, Status
from kernel.sampling_params import SamplingParams
from kernel.scheduling.prefix_reuse import PrefixReuse
from kernel.scheduling.scheduler import Scheduler

EOS = 0


def make_scheduler(num_pages: int = 64, page_size: int = 4, **cfg: int) -> Scheduler:
    conf = SchedulerConfig(
        chunked_prefill_size=cfg.get("chunk", 16),
        max_num_batched_tokens=cfg.get("budget", 32),
        max_running_requests=cfg.get("running", 8),
    )
    table = ReqToTokenTable(conf.max_running_requests + 1, 512, device=torch.device("cpu"))
    allocator = PageAllocator(num_pages)
    cache: PrefixCache
    if cfg.get("radix"):
        cache = RadixTree(page_size, allocator.free, LRU(), strict_events=True)
    else:
        cache = NoPrefixCache(page_size)
    prefix = PrefixReuse(cache, allocator, table)
    return Scheduler(conf, page_size, allocator, table, FCFS(), frozenset({EOS}), 512, prefix)


def make_req(n: int, max_new: int = 8, rid: str | None = None) -> Request:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    return Request(rid=rid or f"r{n}-{random.random()}", prompt_ids=list(range(1, n + 1)), params=params, seed=0)


def run_step(s: Scheduler, token: int = 7) -> list:
    plan = s.schedule()
    s.check_integrity()
    sampled = [SampledToken(token, -0.5, []) for c in plan.chunks if c.samples]
    s.apply(plan, sampled)
    s.check_integrity()
    return plan.chunks


def test_budget_and_chunk_limits() -> None:
    s = make_scheduler(chunk=16, budget=24)
    reqs = [make_req(40), make_req(10)]
    for r in reqs:
        s.add(r)
    chunks = run_step(s)
    assert [(c.req, c.length) for c in chunks] == [(reqs[0], 16), (reqs[1], 8)]
    assert sum(c.length for c in chunks) <= 24


def test_requests_finish_and_release_everything() -> None:
    s = make_scheduler()
    reqs = [make_req(n, max_new=5) for n in (3, 17, 30, 9)]
    for r in reqs:
        s.add(r)
    for _ in range(100):
        if not s.has_work():
            break
        run_step(s)
    assert all(r.status is Status.FINISHED and r.finish_reason == "length" for r in reqs)
    assert all(len(r.output_ids) == 5 for r in reqs)
    assert s.allocator.num_free == s.allocator.num_usable
    assert s.req_table.num_free == s.req_table.num_rows - 1


def test_eos_finishes_unless_ignored() -> None:
    s = make_scheduler()
    a, b = make_req(5), make_req(5)
    b.params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    s.add(a)
    s.add(b)
    for _ in range(10):
        if not s.has_work():
            break
        run_step(s, token=EOS)
    assert a.finish_reason == "stop" and len(a.output_ids) == 1
    assert b.finish_reason == "length" and len(b.output_ids) == 3


def test_decode_out_of_pages_retracts_newest_and_resumes() -> None:
    # 6 usable pages of 4 tokens; two requests of 8 prompt tokens that want 12 more each.
    s = make_scheduler(num_pages=7, page_size=4)
    old, new = make_req(8, max_new=12, rid="old"), make_req(8, max_new=12, rid="new")
    s.add(old)
    s.add(new)
    retracted_seen = False
    for _ in range(200):
        if not s.has_work():
            break
        plan = s.schedule()
        s.check_integrity()
        retracted_seen |= any(r is new for r in plan.retracted)
        assert old not in plan.retracted
        s.apply(plan, [SampledToken(7, 0.0, []) for c in plan.chunks if c.samples])
        s.check_integrity()
    assert retracted_seen and new.num_retractions >= 1
    assert old.finished and new.finished
    assert len(old.output_ids) == 12 and len(new.output_ids) == 12
    assert s.allocator.num_free == s.allocator.num_usable


def test_prefill_short_of_pages_cuts_aligned() -> None:
    s = make_scheduler(num_pages=6, page_size=4, chunk=64, budget=64)  # 5 usable pages
    a, b = make_req(8, max_new=1, rid="a"), make_req(14, max_new=1, rid="b")
    s.add(a)
    s.add(b)
    plan = s.schedule()
    # a takes 2 pages; b's 14 tokens need 4 pages but 3 are free: aligned cut at 12.
    assert [(c.req.rid, c.start, c.length, c.samples) for c in plan.chunks] == [
        ("a", 0, 8, True), ("b", 0, 12, False)]
    s.apply(plan, [SampledToken(7, 0.0, [])])
    s.check_integrity()
    plan = s.schedule()  # a finished (max_new=1) and freed its pages: b's final chunk
    assert [(c.req.rid, c.start, c.length) for c in plan.chunks] == [("b", 12, 2)]


def test_abort_releases_pages_once() -> None:
    s = make_scheduler()
    r = make_req(20)
    s.add(r)
    plan = s.schedule()
    s.abort(r)  # in flight: pages stay until the step lands
    assert r.pages
    s.apply(plan, [SampledToken(7, 0.0, []) for c in plan.chunks if c.samples])
    assert not r.pages and s.allocator.num_free == s.allocator.num_usable
    s.abort(r)  # idempotent
    s.check_integrity()


def test_planted_leak_is_caught() -> None:
    s = make_scheduler()
    r = make_req(20)
    s.add(r)
    run_step(s)
    r.pages.pop()  # a page the request no longer tracks: leaked
    with pytest.raises(AssertionError):
        s.check_integrity()


@pytest.mark.parametrize("radix", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_accounting(seed: int, radix: bool) -> None:
    rng = random.Random(seed)
    s = make_scheduler(num_pages=rng.randint(12, 40), page_size=rng.choice([1, 2, 4, 8]),
                       chunk=16, budget=rng.randint(16, 40), running=rng.randint(1, 6), radix=radix)
    usable_tokens = s.allocator.num_usable * s.page_size
    stems = [[rng.randint(1, 9) for _ in range(30)] for _ in range(3)]  # shared prefixes
    reqs = []
    for i in range(12):
        n = rng.randint(1, 40)
        max_new = rng.randint(1, 10)
        prompt = (rng.choice(stems) + [rng.randint(1, 9) for _ in range(40)])[:n]
        if n + max_new <= usable_tokens:
            req = make_req(n, max_new, rid=f"q{i}")
            req.prompt_ids = prompt
            reqs.append(req)
            s.add(req)
    for _ in range(2000):
        if not s.has_work():
            break
        if rng.random() < 0.02 and s.running:
            s.abort(rng.choice(s.running))
        run_step(s, token=rng.randint(1, 9))
    assert not s.has_work()
    assert all(r.finished for r in reqs)
    for r in reqs:  # tokens never sample EOS: only aborts end a request early
        assert r.finish_reason == "abort" or len(r.output_ids) == r.params.max_new_tokens
    assert s.req_table.num_free == s.req_table.num_rows - 1
    assert s.allocator.num_free + s.prefix.cache.total_pages == s.allocator.num_usable
    prefix, cache = s.prefix, s.prefix.cache
    if not radix:
        assert cache.total_pages == 0 and prefix.hit_tokens == 0
        return
    # Shared stems: later requests reuse earlier KV, in whole pages, never more than asked.
    assert 0 < prefix.hit_tokens <= prefix.query_tokens
    assert prefix.hit_tokens % s.page_size == 0
    # Idle: no request holds a lock, so every cached page can be evicted, and evicting
    # them all gives the allocator back every usable page.
    assert cache.evictable_pages == cache.total_pages > 0
    cache.evict(cache.total_pages)
    assert cache.total_pages == 0 and s.allocator.num_free == s.allocator.num_usable


def test_radix_hit_skips_cached_pages() -> None:
    s = make_scheduler(page_size=4, radix=True)
    first = make_req(10, max_new=2, rid="first")
    s.add(first)
    while s.has_work():
        run_step(s)
    # 10 prompt + 2 generated tokens; KV exists for 11 of them -> 2 whole pages cached.
    assert s.prefix.cache.total_pages == 2
    second = make_req(10, max_new=2, rid="second")
    second.prompt_ids = first.prompt_ids + first.output_ids[:1] + [3, 3]
    s.add(second)
    plan = s.schedule()
    assert second.cached_tokens == 8 and plan.chunks[0].start == 8
    s.apply(plan, [SampledToken(7, 0.0, [])])
    s.check_integrity()


def test_planted_double_owned_page_is_caught() -> None:
    s = make_scheduler(page_size=4, radix=True)
    a = make_req(9, max_new=4, rid="a")
    s.add(a)
    run_step(s)
    assert s.prefix.cache.total_pages == 2  # the tree holds a's first two pages now (9 tokens computed)
    a.shared_pages = 0  # planted: the request claims pages the tree owns
    with pytest.raises(AssertionError):
        s.check_integrity()
