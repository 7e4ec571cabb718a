"""Deterministic mode: a cache hit gives exactly the tokens and logprobs of a cold run.

Every guard compares logprobs with `==` and asserts that the warm run really hit. The
revert-then-red tests at the bottom plant realistic bugs (by monkeypatching, so the
product code carries no test switches) and show that the guards go red.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from kernel import Engine
from kernel.scheduling.prefix_reuse import PrefixReuse
from tests import leaks
from tests.conftest import GRAPHS_EMULATE, TINY_OVERRIDES, assert_replayed, graph_replays
from tests.numerics_compare import TOP, Bounds, check_report, evaluate, reference

PAGE = TINY_OVERRIDES["cache.page_size"]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "return_logprob": True}
SAMPLED = {**GREEDY, "temperature": 0.8, "top_p": 0.95, "seed": 11}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, 40000) for _ in range(n)]


def logprobs(out: dict[str, Any]) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def make(folder: str, **extra: Any) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, "deterministic": True,
                         "cache.prefix": "radix", **extra})


@pytest.fixture(scope="module")
def det(tiny_chat_folder: str) -> Iterator[Engine]:
    engine = make(tiny_chat_folder)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def det_unchecked(tiny_chat_folder: str) -> Iterator[Engine]:
    """No integrity check after each step: a planted bug must be caught by `==` alone."""
    engine = make(tiny_chat_folder, **{"debug.check_invariants": False})
    yield engine
    engine.shutdown()


def cold(engine: Engine, prompt: list[int], params: dict[str, Any] = GREEDY) -> dict[str, Any]:
    assert engine.flush_cache()
    out = engine.generate(prompt, params)
    assert isinstance(out, dict) and out["meta_info"]["cached_tokens"] == 0
    return out


def assert_same(warm: dict[str, Any], ref: dict[str, Any]) -> None:
    assert warm["meta_info"]["cached_tokens"] > 0, "the warm run did not hit the cache"
    assert_bit_exact(warm, ref)


def assert_bit_exact(out: dict[str, Any], ref: dict[str, Any]) -> None:
    """The guard itself; its messages let the planted-bug tests say it was this that fired."""
    assert out["output_ids"] == ref["output_ids"], "bit-exact guard: tokens differ from the cold run"
    assert logprobs(out) == logprobs(ref), "bit-exact guard: logprobs differ from the cold run"  # no tolerance


def assert_hit(warm: dict[str, Any], ref: dict[str, Any], planned: int) -> None:
    """A planned hit: `==` to the cold run, and it reused exactly the planned prefix."""
    assert_bit_exact(warm, ref)
    got = warm["meta_info"]["cached_tokens"]
    assert got == planned, f"hit guard: the warm run reused {got} tokens, not the planned {planned}"


# ---- guards ---------------------------------------------------------------------
def guard_prefill_hit(engine: Engine) -> None:
    """The hit is the warm-up's prefix, which ends mid-page (the cold run's own insert is
    flushed first): its whole pages, where its generated tokens part from the prompt."""
    prompt, warm_up = tokens(1, 90), 61
    for params in (GREEDY, SAMPLED):
        ref = cold(engine, prompt, params)
        assert engine.flush_cache()
        engine.generate(prompt[:warm_up], GREEDY)
        assert_hit(engine.generate(prompt, params), ref, warm_up // PAGE * PAGE)  # type: ignore[arg-type]


def guard_decode_hit(engine: Engine) -> None:
    first = tokens(2, 37)
    engine.flush_cache()
    turn1 = engine.generate(first, GREEDY)
    turn2 = first + turn1["output_ids"] + tokens(3, 9)  # type: ignore[index]
    warm = engine.generate(turn2, GREEDY)
    assert isinstance(warm, dict) and warm["meta_info"]["cached_tokens"] > len(first)
    assert_same(warm, cold(engine, turn2))


def guard_branching(engine: Engine, noise: int = 0) -> None:
    """A conversation tree whose branch points are not page multiples."""
    root = tokens(4, 4 * PAGE + 2)
    branches = [root + tokens(10 + b, 3 + 2 * b) for b in range(3)]
    convs = [b + tokens(20 + i, 5) for i, b in enumerate(branches)] + branches
    refs = [cold(engine, c) for c in convs]
    engine.flush_cache()
    others = [tokens(100 + i, 5 + 4 * i) for i in range(noise)]  # fits the pool beside the tree
    params = [GREEDY] * len(others)
    engine.generate(root, GREEDY)
    for conv, ref in zip(convs, refs):
        outs = engine.generate(others + [conv], params + [GREEDY])
        warm = outs[-1]  # type: ignore[index]
        assert warm["meta_info"]["cached_tokens"] % PAGE == 0
        assert_same(warm, ref)


def test_a_prefill_hit(det: Engine) -> None:
    guard_prefill_hit(det)


def test_b_decode_hit(det: Engine) -> None:
    guard_decode_hit(det)


def test_c_branching_conversations(det: Engine) -> None:
    guard_branching(det)


def test_d_under_16_concurrent_requests(det: Engine) -> None:
    guard_branching(det, noise=15)


def guard_small_pool(engine: Engine) -> int:
    """Returns how many pages were evicted while checking every result against cold."""
    evicted: list[int] = []
    unsubscribe = engine.engine.subscribe_kv_events(
        lambda events: evicted.extend(len(getattr(e, "block_hashes", [])) for e in events
                                      if type(e).__name__ == "BlockRemoved"))
    assert unsubscribe is not None, "the radix cache publishes KV events"
    shared = tokens(5, 48)
    prompts = [shared + tokens(30 + i, 20 + 7 * i) for i in range(6)]
    refs = [cold(engine, p) for p in prompts]
    engine.flush_cache()
    # All at once: chunked prefills compete for 40 pages, the cache evicts while they run.
    outs = engine.generate(prompts, [GREEDY] * len(prompts))
    for out, ref in zip(outs, refs):  # type: ignore[arg-type]
        assert_bit_exact(out, ref)  # hit or not, nothing may change the numbers
    # One by one: each finds at least the shared prefix, which the one before it used.
    for prompt, ref in zip(prompts, refs):
        assert_same(engine.generate(prompt, GREEDY), ref)  # type: ignore[arg-type]
    return sum(evicted)


def test_e_small_pool_with_eviction_and_chunking(tiny_chat_folder: str) -> None:
    # 40 usable pages of 4 tokens: six ~100-token requests cannot all stay cached.
    engine = make(tiny_chat_folder, **{"cache.num_pages": 41, "scheduler.chunked_prefill_size": 16,
                                       "scheduler.max_num_batched_tokens": 32})
    try:
        assert guard_small_pool(engine) > 0
    finally:
        engine.shutdown()


# ---- the same guards with the graph runner emulated (graphs.mode: emulate) --------
@pytest.fixture(scope="module")
def det_emulate(tiny_chat_folder: str) -> Iterator[Engine]:
    engine = make(tiny_chat_folder, **GRAPHS_EMULATE)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    "guard",
    [guard_prefill_hit, guard_decode_hit, guard_branching, lambda e: guard_branching(e, noise=15)],
    ids=["a-prefill", "b-decode", "c-branching", "d-concurrent"],
)
def test_guards_with_graphs_emulated(det_emulate: Engine, guard: Any) -> None:
    before = graph_replays(det_emulate)
    guard(det_emulate)
    assert_replayed(det_emulate, before)


def test_e_small_pool_with_graphs_emulated(tiny_chat_folder: str) -> None:
    engine = make(tiny_chat_folder, **GRAPHS_EMULATE, **{"cache.num_pages": 41, "scheduler.chunked_prefill_size": 16,
                                                         "scheduler.max_num_batched_tokens": 32})
    try:
        assert guard_small_pool(engine) > 0
        assert_replayed(engine, {"decode": 0, "prefill": 0})
    finally:
        engine.shutdown()


def test_graphs_emulated_equal_graphs_off(det: Engine, det_emulate: Engine) -> None:
    """Padding rows never change a live row: the same concurrent workload, `==`."""
    prompts = [tokens(40 + i, 5 + 9 * i) for i in range(7)]
    params = [GREEDY, SAMPLED] * 3 + [GREEDY]
    for engine in (det, det_emulate):
        assert engine.flush_cache()
    off, emulated = det.generate(prompts, params), det_emulate.generate(prompts, params)
    for a, b in zip(off, emulated):  # type: ignore[arg-type]
        assert_bit_exact(b, a)


def test_deterministic_matches_default_numerics(det: Engine, tiny_engine: Engine) -> None:
    """Two modes, two reduction orders: compared teacher-forced (tests/numerics_compare.py),
    float32 both: measured max |Δ logprob| 1.9e-6 on an AMD EPYC AVX2, 2.0e-6 on
    an Intel Xeon AVX-512/BF16/AMX (the old free-running
    bound was max < 1e-4)."""
    assert det.flush_cache()
    ref = reference(det, [tokens(6, 50)], {**GREEDY, "top_logprobs_num": TOP})
    check_report(evaluate(tiny_engine, ref, 1e-3), Bounds(mean=1e-5, p99=1e-4, agreement=1.0, gap=1e-3))


# ---- revert-then-red: planted bugs make the guards fail -------------------------
@pytest.mark.parametrize(
    "guard",
    [guard_prefill_hit, guard_decode_hit, guard_branching, lambda e: guard_branching(e, noise=15)],
    ids=["a-prefill", "b-decode", "c-branching", "d-concurrent"],
)
def test_red_off_by_one_in_reused_prefix(
    det_unchecked: Engine, monkeypatch: pytest.MonkeyPatch, guard: Any
) -> None:
    """Caught by the bit-exact compare on its own (the integrity check is off). The reused
    slots move by a page and a token: deterministic mode's paged kernel reads a page from
    its first slot, so a shift inside pages alone it never sees (nor computes wrong)."""
    real_match = PrefixReuse.match
    shift = PAGE + 1

    def off_by_one(self: PrefixReuse, req: Any) -> None:
        real_match(self, req)
        if req.kv_len:  # reused slots shifted
            row = self.req_table.table[req.row]
            row[: req.kv_len] = row[shift : req.kv_len + shift].clone()

    monkeypatch.setattr(PrefixReuse, "match", off_by_one)
    with pytest.raises(AssertionError, match="bit-exact guard"):
        guard(det_unchecked)


def test_red_unaligned_cut_under_pool_pressure(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import kernel.scheduling.scheduler as sched_mod

    def unaligned(start: int, total: int, page_size: int, token_budget: int, owned_pages: int,
                  free_pages: int, grid: int | None = None) -> int:
        capacity = (owned_pages + free_pages) * page_size - start
        return max(min(total - start, token_budget, capacity - 1), 0)  # cut wherever pages end

    monkeypatch.setattr(sched_mod, "plan_chunk", unaligned)
    engine = make(tiny_chat_folder, **{"cache.num_pages": 41, "scheduler.chunked_prefill_size": 16,
                                       "scheduler.max_num_batched_tokens": 32})
    try:
        with pytest.raises(AssertionError, match="cut at unaligned"):  # the per-step integrity check
            guard_small_pool(engine)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


@pytest.mark.parametrize("check_invariants", [True, False])
def test_red_stale_page_after_eviction(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch, check_invariants: bool
) -> None:
    """Caught by the page accounting when it runs, and by the bit-exact compare alone."""
    from cache.radix_tree import RadixTree

    # Forgetting to lock matched nodes: eviction frees pages a running request still reads.
    monkeypatch.setattr(RadixTree, "lock", lambda self, node: None)
    monkeypatch.setattr(RadixTree, "unlock", lambda self, node: None)
    engine = make(tiny_chat_folder, **{"cache.num_pages": 41, "scheduler.chunked_prefill_size": 16,
                                       "scheduler.max_num_batched_tokens": 32,
                                       "debug.check_invariants": check_invariants})
    # With the check: page accounting (a page both held and cached, or counted twice);
    # without it: the bit-exact compare on its own.
    caught_by = "page leak|held|cached" if check_invariants else "bit-exact guard"
    try:
        with pytest.raises(AssertionError, match=caught_by):
            guard_small_pool(engine)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


def test_red_hit_from_the_cold_runs_insert(det_unchecked: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a flush that keeps the tree. The warm run then hits the cold run's own
    insert (the whole prompt), not the warm-up's prefix: `==` holds, the hit guard fires."""
    from kernel.engine import Engine as OfflineEngine

    assert det_unchecked.flush_cache()  # the cold run's "flush" below must find it empty
    monkeypatch.setattr(OfflineEngine, "flush_cache", lambda self: True)
    with pytest.raises(AssertionError, match="hit guard: the warm run reused 88 tokens, not the planned 60"):
        guard_prefill_hit(det_unchecked)


def test_red_emulated_guard_without_replays(det_emulate: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the graph runner finds no bucket (every step eager): the replay guard fires."""
    from gpu.graphs.runner import GraphRunner

    monkeypatch.setattr(GraphRunner, "bucket_for", lambda self, batch: None)
    with pytest.raises(AssertionError, match=r"replay guard: no \['decode', 'prefill'\] graph replayed"):
        test_guards_with_graphs_emulated(det_emulate, guard_decode_hit)
