"""Hybrid models, deterministic mode: a cache hit resumes from a cached recurrent state and
gives exactly the tokens and logprobs of a cold run — for every state strategy, both
families, prefill hits and decode hits, branching conversations, under concurrency, and
with a pool so short that a continuing chunk must be cut under pressure.

Each strategy has its own guard class (`extra_buffer_lazy` is a different code path,
not a flag). The revert-then-red tests plant, by monkeypatching from the test, the bugs
of the field reports: an unaligned continuing cut, a stale track slot, a wrong
ping-pong slot pick, an off-by-one checkpoint length.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from handlers.state_extra_buffer import ExtraBuffer
from handlers.state_extra_buffer_lazy import ExtraBufferLazy
from kernel import Engine
from kernel.request import Request
from kernel.scheduling.prefix_reuse import PrefixReuse
from tests import leaks
from tests.conftest import GRAPHS_EMULATE, HYBRID_FAMILIES, HYBRID_OVERRIDES, assert_replayed, graph_replays
from tests.tiny_hybrid import VOCAB

INTERVAL = HYBRID_OVERRIDES["cache.state_track_interval"]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "return_logprob": True}
SAMPLED = {**GREEDY, "temperature": 0.8, "top_p": 0.95, "seed": 7}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def logprobs(out: dict[str, Any]) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def make(folder: str, strategy: str, **extra: Any) -> Engine:
    return Engine(None, {**HYBRID_OVERRIDES, "model.path": folder, "deterministic": True,
                         "cache.state_strategy": strategy, **extra})


def cold(engine: Engine, prompt: list[int], params: dict[str, Any] = GREEDY) -> dict[str, Any]:
    assert engine.flush_cache()
    out = engine.generate(prompt, params)
    assert isinstance(out, dict) and out["meta_info"]["cached_tokens"] == 0
    return out


def assert_bit_exact(out: dict[str, Any], ref: dict[str, Any]) -> None:
    assert out["output_ids"] == ref["output_ids"], "bit-exact guard: tokens differ from the cold run"
    assert logprobs(out) == logprobs(ref), "bit-exact guard: logprobs differ from the cold run"


def assert_same(warm: dict[str, Any], ref: dict[str, Any]) -> None:
    assert warm["meta_info"]["cached_tokens"] > 0, "the warm run did not hit the cache"
    assert_bit_exact(warm, ref)


def assert_hit(warm: dict[str, Any], ref: dict[str, Any], planned: int) -> None:
    """A planned hit: `==` to the cold run, and it resumed from exactly the planned state."""
    assert_bit_exact(warm, ref)
    got = warm["meta_info"]["cached_tokens"]
    assert got == planned, f"hit guard: the warm run reused {got} tokens, not the planned {planned}"


# ---- guards ---------------------------------------------------------------------
def guard_prefill_hit(engine: Engine) -> None:
    """The hit is the warm-up's prefix, which ends off the grid (the cold run's own insert
    is flushed first): its last checkpoint, before its generated tokens part from the prompt."""
    prompt, warm_up = tokens(1, 5 * INTERVAL + 3), 3 * INTERVAL + 5
    for params in (GREEDY, SAMPLED):
        ref = cold(engine, prompt, params)
        assert engine.flush_cache()
        engine.generate(prompt[:warm_up], GREEDY)
        assert_hit(engine.generate(prompt, params), ref, warm_up // INTERVAL * INTERVAL)  # type: ignore[arg-type]


def guard_decode_hit(engine: Engine) -> None:
    """The second turn resumes from a state checkpointed while the first turn decoded."""
    first = tokens(2, 2 * INTERVAL + 3)
    engine.flush_cache()
    turn1 = engine.generate(first, {**GREEDY, "max_new_tokens": 2 * INTERVAL})
    turn2 = first + turn1["output_ids"] + tokens(3, 5)  # type: ignore[index]
    warm = engine.generate(turn2, GREEDY)
    assert isinstance(warm, dict) and warm["meta_info"]["cached_tokens"] > len(first)
    assert_same(warm, cold(engine, turn2))


def guard_branching(engine: Engine, noise: int = 0) -> None:
    """A conversation tree whose branch points are off the page and checkpoint grids."""
    root = tokens(4, 2 * INTERVAL + 3)
    branches = [root + tokens(10 + b, 3 + 5 * b) for b in range(3)]
    convs = [b + tokens(20 + i, INTERVAL + 1) for i, b in enumerate(branches)] + branches
    refs = [cold(engine, c) for c in convs]
    engine.flush_cache()
    others = [tokens(100 + i, 5 + 3 * i) for i in range(noise)]
    engine.generate(root, GREEDY)
    for conv, ref in zip(convs, refs):
        outs = engine.generate(others + [conv], [GREEDY] * (noise + 1))
        warm = outs[-1]  # type: ignore[index]
        assert warm["meta_info"]["cached_tokens"] % INTERVAL == 0
        assert_same(warm, ref)


def guard_small_pool(engine: Engine) -> None:
    """Pages so short that continuing chunks are cut under pressure, eviction running."""
    shared = tokens(5, 3 * INTERVAL)
    prompts = [shared + tokens(30 + i, 9 + 5 * i) for i in range(5)]
    refs = [cold(engine, p) for p in prompts]
    engine.flush_cache()
    outs = engine.generate(prompts, [GREEDY] * len(prompts))  # all at once: cuts and evictions
    for out, ref in zip(outs, refs):  # type: ignore[arg-type]
        assert_bit_exact(out, ref)
    for prompt, ref in zip(prompts, refs):  # one by one: each finds the shared prefix
        assert_same(engine.generate(prompt, GREEDY), ref)  # type: ignore[arg-type]


def record_page_cuts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(start, length) of every prefill chunk the planner cut short for lack of pages."""
    import kernel.scheduling.scheduler as sched_mod

    real = sched_mod.plan_chunk
    cuts: list[tuple[int, int]] = []

    def recording(start: int, total: int, page_size: int, token_budget: int, owned_pages: int,
                  free_pages: int, grid: int | None = None) -> int:
        length = real(start, total, page_size, token_budget, owned_pages, free_pages, grid)
        by_pages = (owned_pages + free_pages) * page_size - start < min(total - start, token_budget)
        if by_pages and length < total - start:
            cuts.append((start, length))
        return length

    monkeypatch.setattr(sched_mod, "plan_chunk", recording)
    return cuts


SMALL_POOL = {"cache.num_pages": 30, "scheduler.chunked_prefill_size": 16,
              "scheduler.max_num_batched_tokens": 24}


class _Guards:
    strategy = ""
    extra: ClassVar[dict[str, Any]] = {}  # more overrides (the emulated graph runner)

    @pytest.fixture(scope="class", params=HYBRID_FAMILIES)
    @classmethod
    def det(cls, request: pytest.FixtureRequest, hybrid_folders: dict[str, str]) -> Iterator[Engine]:
        engine = make(hybrid_folders[request.param], cls.strategy, **cls.extra)
        yield engine
        engine.shutdown()

    def check(self, engine: Engine, guard: Any, *args: Any) -> None:
        """Run the guard; with graphs emulated, it ran in decode and prefill buckets."""
        before = graph_replays(engine) if self.extra else {}
        guard(engine, *args)
        if self.extra:
            assert_replayed(engine, before)

    def test_a_prefill_hit(self, det: Engine) -> None:
        self.check(det, guard_prefill_hit)

    def test_b_decode_hit(self, det: Engine) -> None:
        self.check(det, guard_decode_hit)

    def test_c_branching(self, det: Engine) -> None:
        self.check(det, guard_branching)

    def test_d_under_16_concurrent_requests(self, det: Engine) -> None:
        self.check(det, guard_branching, 15)

    @pytest.mark.parametrize("family", HYBRID_FAMILIES)
    def test_e_continuing_chunk_cut_under_pressure(
        self, hybrid_folders: dict[str, str], family: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        cuts = record_page_cuts(monkeypatch)
        engine = make(hybrid_folders[family], self.strategy, **SMALL_POOL, **self.extra)
        try:
            self.check(engine, guard_small_pool)
        finally:
            engine.shutdown()
        # The field report's scenario happened: a continuing chunk cut short by pages.
        assert any(start > 0 for start, _ in cuts), cuts


class TestNoBuffer(_Guards):
    strategy = "no_buffer"


class TestExtraBuffer(_Guards):
    strategy = "extra_buffer"


class TestExtraBufferLazy(_Guards):
    strategy = "extra_buffer_lazy"


# The same guards with the graph runner emulated (graphs.mode: emulate), every strategy.
class TestNoBufferGraphsEmulated(_Guards):
    strategy = "no_buffer"
    extra = GRAPHS_EMULATE


class TestExtraBufferGraphsEmulated(_Guards):
    strategy = "extra_buffer"
    extra = GRAPHS_EMULATE


class TestExtraBufferLazyGraphsEmulated(_Guards):
    strategy = "extra_buffer_lazy"
    extra = GRAPHS_EMULATE


# ---- revert-then-red ------------------------------------------------------------
def run_red(folder: str, strategy: str, guard: Any, caught_by: str, **extra: Any) -> None:
    engine = make(folder, strategy, **extra)
    try:
        # AssertionError: the bit-exact compare or the integrity check (which halts the
        # engine with it); RuntimeError: the slot allocator's double-free check.
        with pytest.raises((AssertionError, RuntimeError), match=caught_by):
            guard(engine)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_red_unaligned_continuing_cut(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """The field report: a continuing chunk cut wherever the pages end."""
    import kernel.scheduling.scheduler as sched_mod

    def unaligned(start: int, total: int, page_size: int, token_budget: int, owned_pages: int,
                  free_pages: int, grid: int | None = None) -> int:
        capacity = (owned_pages + free_pages) * page_size - start
        return max(min(total - start, token_budget, capacity - 1), 0)

    monkeypatch.setattr(sched_mod, "plan_chunk", unaligned)
    run_red(hybrid_folders["qwen3_5_text"], strategy, guard_small_pool, "unaligned|off the grid|bit-exact",
            **SMALL_POOL)


def plant_stale_track(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request writes its next checkpoint into a slot the cache already owns."""
    if strategy == "extra_buffer":
        real = ExtraBuffer.after_insert

        def keep_donated(self: Any, req: Request, slot: int, donated: bool, slots: Any) -> None:
            real(self, req, slot, donated, slots)
            if donated:
                if req.track_slot is not None:
                    slots.free(req.track_slot)
                req.track_slot = slot  # planted: the donated slot stays our track slot

        monkeypatch.setattr(ExtraBuffer, "after_insert", keep_donated)
    else:
        def reuse_lent(self: Any, req: Request, slots: Any) -> int:
            # Planted: the lent (cached) slot reused as the second slot when there is one.
            req.track_slot = req.resume_slot if req.resume_slot is not None else slots.allocate()
            return req.track_slot if req.track_slot is not None else req.state_slot

        monkeypatch.setattr(ExtraBufferLazy, "checkpoint_dst", reuse_lent)


def test_red_no_buffer_checkpoint_without_its_copy(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """no_buffer's stale slot: the cached slot is handed over but the live state is never
    copied into it, so the cache holds whatever that slot held before."""
    from handlers.state_no_buffer import NoBuffer

    monkeypatch.setattr(NoBuffer, "take_checkpoint", lambda self, req, written, slots: slots.allocate())
    run_red(hybrid_folders["qwen3_5_text"], "no_buffer", guard_prefill_hit, "bit-exact",
            **{"debug.check_invariants": False, "scheduler.chunked_prefill_size": INTERVAL})


# Which guard sees the stale track slot: the per-step accounting, else the allocator's
# always-on double-free check. (With that check planted away too, guard_prefill_hit's
# outputs stay `==`: the overwritten slot is not one its warm run resumes from.)
CAUGHT_BY = {"accounting": "state slot leak", "allocator": r"state slot \d+ freed twice or never allocated"}


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
@pytest.mark.parametrize("caught_by", list(CAUGHT_BY))
def test_red_stale_track_slot(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str, caught_by: str
) -> None:
    """A checkpoint lands in another position's cached slot: a slot with two owners."""
    plant_stale_track(strategy, monkeypatch)
    # One checkpoint per chunk: every chunk after a donation starts from a lent slot.
    run_red(hybrid_folders["qwen3_5_text"], strategy, guard_prefill_hit, CAUGHT_BY[caught_by],
            **{"debug.check_invariants": caught_by == "accounting", "scheduler.chunked_prefill_size": INTERVAL})


@pytest.mark.parametrize("strategy", [ExtraBuffer, ExtraBufferLazy], ids=["extra_buffer", "extra_buffer_lazy"])
def test_red_wrong_ping_pong_pick(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: Any
) -> None:
    """After a donation the next chunk reads the live slot (an older state) instead of
    the donated one: only the bit-exact compare can see it."""
    real = strategy.after_insert

    def wrong_pick(self: Any, req: Request, slot: int, donated: bool, slots: Any) -> None:
        real(self, req, slot, donated, slots)
        req.resume_slot = None  # planted: resume from the live slot

    monkeypatch.setattr(strategy, "after_insert", wrong_pick)
    name = "extra_buffer" if strategy is ExtraBuffer else "extra_buffer_lazy"
    run_red(hybrid_folders["lfm2"], name, guard_prefill_hit, "bit-exact", **{"debug.check_invariants": False})


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_red_off_by_one_checkpoint_length(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """A state cached one page short of where it was taken: a later hit resumes from a
    state ahead of its KV (the field report's 420-vs-384), caught by `==`."""
    real = PrefixReuse.cache_checkpoint

    def short(self: PrefixReuse, req: Request, state_slot: int, length: int) -> bool:
        # Planted: insert one page fewer than the state covers.
        return real(self, req, state_slot, length - self.page_size)

    monkeypatch.setattr(PrefixReuse, "cache_checkpoint", short)
    run_red(hybrid_folders["qwen3_5_text"], strategy, guard_prefill_hit, "bit-exact",
            **{"debug.check_invariants": False})


def test_red_hit_from_the_cold_runs_insert(hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a flush that keeps the tree. The warm run then resumes from the cold run's
    own deepest checkpoint, not the warm-up's: `==` holds, the hit guard fires."""
    from kernel.engine import Engine as OfflineEngine

    monkeypatch.setattr(OfflineEngine, "flush_cache", lambda self: True)
    planned, deepest = 3 * INTERVAL, 5 * INTERVAL
    run_red(hybrid_folders["lfm2"], "extra_buffer", guard_prefill_hit,
            f"hit guard: the warm run reused {deepest} tokens, not the planned {planned}")


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_red_emulated_guard_without_replays(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """Planted: the graph runner finds no bucket (every step eager): the replay guard fires."""
    from gpu.graphs.runner import GraphRunner

    monkeypatch.setattr(GraphRunner, "bucket_for", lambda self, batch: None)
    guards = TestNoBufferGraphsEmulated() if strategy == "no_buffer" else TestExtraBufferGraphsEmulated()
    run_red(hybrid_folders["qwen3_5_text"], strategy, lambda e: guards.check(e, guard_decode_hit),
            r"replay guard: no \['decode', 'prefill'\] graph replayed", **GRAPHS_EMULATE)
