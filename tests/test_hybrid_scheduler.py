"""The scheduler with hybrid state, no model: random prompt lengths, page sizes, chunk
sizes, checkpoint intervals, pool sizes and strategies. After every step the integrity
check runs — every cached state slot's length equals its node's key length, every slot
has exactly one owner, every checkpoint and every continuing cut is on the grid — and
the step's plan is checked against the grid directly.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.allocator import PageAllocator
from cache.radix_tree import RadixTree
from cache.req_table import ReqToTokenTable
from cache.state_pool import LayerStateShape, StatePool
from gpu.forward_batch import SampledToken
from handlers.evict_lru import LRU
from handlers.fcfs import FCFS
from kernel.config import SchedulerConfig
from kernel.registry import lookup
from kernel.request import Request
from kernel.sampling_params import SamplingParams
from kernel.scheduling.prefix_reuse import PrefixReuse
from kernel.scheduling.scheduler import Scheduler
from kernel.states.hybrid_state import HybridState

CPU = torch.device("cpu")


def make(page: int, interval: int, chunk: int, pages: int, slots: int, strategy: str) -> Scheduler:
    conf = SchedulerConfig(chunked_prefill_size=chunk, max_num_batched_tokens=chunk + 8, max_running_requests=6)
    table = ReqToTokenTable(conf.max_running_requests + 1, 1024, CPU)
    allocator = PageAllocator(pages)
    pool = StatePool([LayerStateShape(1, 1, None)], slots, torch.float32, CPU)

    def free_states(freed: list[int]) -> None:
        for slot in freed:
            pool.free(slot)

    tree = RadixTree(page, allocator.free, LRU(), strict_events=True, free_states=free_states)
    hybrid = HybridState(pool, lookup("state_strategy", strategy)(), interval, True, tree.evict_states)
    prefix = PrefixReuse(tree, allocator, table, hybrid=True)
    return Scheduler(conf, page, allocator, table, FCFS(), frozenset(), 1024, prefix, hybrid)


def step(s: Scheduler, rng: random.Random) -> None:
    plan = s.schedule()
    s.check_integrity()
    for chunk in plan.chunks:
        end = chunk.start + chunk.length
        if end < chunk.req.total_len:  # a continuing chunk: on the checkpoint grid
            assert end % s.grid == 0, (chunk.start, chunk.length, s.grid)
    assert s.hybrid is not None
    s.hybrid.take_copies()  # what the device thread would run before the forward
    s.apply(plan, [SampledToken(rng.randint(1, 9), 0.0, []) for c in plan.chunks if c.samples])
    s.check_integrity()


@settings(max_examples=40, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4]),
    grid_pages=st.integers(1, 4),
    chunk=st.integers(4, 24),
    pages=st.integers(24, 80),
    slots=st.integers(3, 24),
    strategy=st.sampled_from(["no_buffer", "extra_buffer", "extra_buffer_lazy"]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    seed=st.integers(0, 1000),
)
def test_random_workloads_keep_state_lengths_and_owners_exact(
    page: int, grid_pages: int, chunk: int, pages: int, slots: int, strategy: str, lengths: list[int], seed: int
) -> None:
    interval = page * grid_pages
    s = make(page, interval, max(chunk, interval), pages, slots, strategy)
    rng = random.Random(seed)
    stems = [[rng.randint(1, 5) for _ in range(30)] for _ in range(2)]  # shared prefixes: hits
    usable = (pages - 1) * page
    reqs = []
    for i, n in enumerate(lengths):
        max_new = rng.randint(1, 12)
        prompt = (stems[i % 2] + [rng.randint(1, 5) for _ in range(n)])[: n + 5]
        if len(prompt) + max_new > usable:  # the engine's admission refuses these
            continue
        req = Request(rid=f"r{i}", prompt_ids=prompt, seed=0,
                      params=SamplingParams(max_new_tokens=max_new, temperature=0.0))
        reqs.append(req)
        s.add(req)
    for _ in range(3000):
        if not s.has_work():
            break
        if rng.random() < 0.03 and s.running:
            s.abort(rng.choice(s.running))
        step(s, rng)
    assert not s.has_work()
    assert all(r.finished for r in reqs)
    assert s.hybrid is not None
    # Idle: every slot is free or cached; evicting every state gives them all back.
    tree = s.prefix.cache
    assert s.hybrid.pool.num_free + tree.total_states == s.hybrid.pool.num_usable
    tree.evict_states(tree.total_states)
    assert s.hybrid.pool.num_free == s.hybrid.pool.num_usable


def run_fixed(strategy: str) -> Scheduler:
    s = make(page=4, interval=8, chunk=16, pages=64, slots=16, strategy=strategy)
    rng = random.Random(0)
    stem = [rng.randint(1, 5) for _ in range(20)]
    for i in range(6):
        s.add(Request(rid=f"f{i}", prompt_ids=stem + [i + 1] * (3 + i), seed=0,
                      params=SamplingParams(max_new_tokens=10, temperature=0.0)))
        while s.has_work():
            step(s, rng)
    return s


def test_fixed_workload_checkpoints_and_hits() -> None:
    for strategy in ("no_buffer", "extra_buffer", "extra_buffer_lazy"):
        s = run_fixed(strategy)
        assert s.prefix.hit_tokens >= 5 * 16, strategy  # each later request resumes the stem's state
        assert s.prefix.cache.total_states > 0


def test_red_checkpoint_length_off_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    real = HybridState.after_step

    def off_by_one(self: HybridState, req: Request) -> int | None:
        slot = real(self, req)
        if slot is not None:
            req.checkpoint_len -= 1  # planted
        return slot

    monkeypatch.setattr(HybridState, "after_step", off_by_one)
    with pytest.raises(AssertionError, match="off the grid"):
        run_fixed("extra_buffer")
