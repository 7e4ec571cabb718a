"""Scheduling handlers (fcfs, lpm, dfs_weight) and in-batch prefix sharing."""

from __future__ import annotations

from kernel import registry
from kernel.request import Request
from tests.test_scheduler import make_req, make_scheduler, run_step


def prompt_req(rid: str, tokens: list[int], max_new: int = 2) -> Request:
    req = make_req(len(tokens), max_new, rid=rid)
    req.prompt_ids = list(tokens)
    return req


def warm(s, tokens: list[int]) -> None:  # type: ignore[no-untyped-def]
    s.add(prompt_req("warm", tokens))
    while s.has_work():
        run_step(s)


def test_lpm_orders_by_cached_prefix_then_falls_back_to_fcfs() -> None:
    s = make_scheduler(page_size=4, radix=True)
    hot = list(range(1, 33))
    warm(s, hot)
    cold = prompt_req("cold", [50 + i for i in range(20)])
    half = prompt_req("half", hot[:16] + [99] * 8)
    full = prompt_req("full", hot + [98] * 4)
    lpm = registry.lookup("schedule", "lpm")(lpm_fallback_queue=8)
    assert [r.rid for r in lpm.order([cold, half, full], s.prefix)] == ["full", "half", "cold"]
    small_queue = registry.lookup("schedule", "lpm")(lpm_fallback_queue=2)
    assert [r.rid for r in small_queue.order([cold, half, full], s.prefix)] == ["cold", "half", "full"]
    hits_before = s.prefix.hit_tokens
    lpm.order([cold, half, full], s.prefix)
    assert s.prefix.hit_tokens == hits_before


def test_dfs_weight_groups_requests_of_the_heaviest_prefix() -> None:
    s = make_scheduler(page_size=4, radix=True)
    a, b = [1] * 16, [2] * 16
    warm(s, a + [3])
    warm(s, b + [3])
    reqs = [
        prompt_req("b1", b + [7, 7, 7, 7, 5]),
        prompt_req("a1", a + [5, 5, 5, 5, 5]),
        prompt_req("x", [9] * 9),
        prompt_req("a2", a + [6, 6, 6, 6, 5]),
        prompt_req("a3", a + [8, 8]),
    ]
    dfs = registry.lookup("schedule", "dfs_weight")()
    order = [r.rid for r in dfs.order(reqs, s.prefix)]
    assert order[:3] == ["a1", "a2", "a3"] and order[3] == "b1" and order[-1] == "x"
    assert sorted(order) == sorted(r.rid for r in reqs)


def test_request_waits_for_a_prefix_being_computed_then_reuses_it() -> None:
    s = make_scheduler(page_size=4, radix=True, chunk=16, budget=64)
    shared = list(range(1, 65))  # 64 tokens: four 16-token chunks for the first request
    first, second = prompt_req("first", shared + [100]), prompt_req("second", shared + [200])
    s.add(first)
    s.add(second)
    chunks = run_step(s)
    assert [c.req.rid for c in chunks] == ["first"]  # second waits instead of recomputing
    while not second.kv_len and s.has_work():
        chunks = run_step(s)
    assert second.cached_tokens == 64
    assert sum(c.length for c in chunks if c.req is second) == 1  # only its own last token


def test_sharing_off_computes_twice() -> None:
    s = make_scheduler(page_size=4, radix=True, chunk=16, budget=64)
    s.config = s.config.__class__(**{**s.config.__dict__, "share_prefix_min_tokens": 0})
    shared = list(range(1, 65))
    s.add(prompt_req("first", shared + [100]))
    s.add(prompt_req("second", shared + [200]))
    assert [c.req.rid for c in run_step(s)] == ["first", "second"]
