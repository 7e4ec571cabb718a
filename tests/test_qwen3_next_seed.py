"""The seeds' launch (config/qwen3-next-seed.yaml: a tiny random Qwen3-Next, page size 64,
chunked prefill 256, extra_buffer, host tier at ratio 1, deterministic) replaying the field
report's bug 1: under KV-pool pressure, with decodes sharing each step's token budget, a
continuing prefill chunk is left a budget off the 64-token grid; it must be cut back to
the grid (a cached state covers exactly its node's key length, which the integrity check
asserts at every insert), and a follow-up sharing the prefix must be `==` its cold run.
Planted: the continuing chunk cut wherever its budget ends (the report's bug) -> red."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kernel import Engine
from kernel.config import load_config
from tests import leaks
from tests.test_bit_exact_hybrid import assert_bit_exact, tokens

SEED = Path(__file__).resolve().parent.parent / "config" / "qwen3-next-seed.yaml"
GRID = 64
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "return_logprob": True}
# Three short requests decode while five long prompts prefill: 5 x 12 pages of prompt
# alone outgrow the 64-page pool (pressure), and the decodes take tokens from every
# step's 256-token budget (a continuing chunk's budget off the grid).
SHARED = tokens(1, 300)
LONG = [SHARED + tokens(10 + i, 400 + 37 * i) for i in range(5)]
SHORT = [tokens(20 + i, 5) for i in range(3)]
FOLLOW_UP = LONG[0][:520] + tokens(99, 30)


def record_chunks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(start, limit, length) of every continuing chunk the planner cut short: `limit` is
    what its token budget and pages allowed."""
    import kernel.scheduling.scheduler as sched_mod

    real = sched_mod.plan_chunk
    cuts: list[tuple[int, int, int]] = []

    def recording(start: int, total: int, page_size: int, token_budget: int, owned_pages: int,
                  free_pages: int, grid: int | None = None) -> int:
        length = real(start, total, page_size, token_budget, owned_pages, free_pages, grid)
        limit = min(token_budget, (owned_pages + free_pages) * page_size - start)
        if start > 0 and limit < total - start:
            cuts.append((start, limit, length))
        return length

    monkeypatch.setattr(sched_mod, "plan_chunk", recording)
    return cuts


def replay_bug_1(engine: Engine) -> None:
    """Cold reference of the follow-up, then the pressured batch, then the follow-up warm."""
    assert engine.flush_cache()
    cold = engine.generate(FOLLOW_UP, GREEDY)
    assert isinstance(cold, dict) and cold["meta_info"]["cached_tokens"] == 0
    assert engine.flush_cache()
    engine.generate(SHORT + LONG, [{**GREEDY, "max_new_tokens": 40}] * 3 + [GREEDY] * 5)
    warm = engine.generate(FOLLOW_UP, GREEDY)
    assert isinstance(warm, dict) and warm["meta_info"]["cached_tokens"] >= 256, warm["meta_info"]
    assert_bit_exact(warm, cold)


def seed_engine(**overrides: Any) -> Engine:
    return Engine(load_config(SEED, overrides))


def test_the_seed_config_is_the_seeds_launch() -> None:
    config = load_config(SEED)
    assert config.model.path == "random:qwen3_next" and config.deterministic
    assert (config.cache.page_size, config.scheduler.chunked_prefill_size) == (64, 256)
    assert config.cache.state_strategy == "extra_buffer" and config.hicache.host_ratio == 1
    assert config.debug.check_invariants and config.parallel.tp_size == 2


@pytest.mark.parametrize("tp", [2, 1])
def test_bug_1_replayed(monkeypatch: pytest.MonkeyPatch, tp: int) -> None:
    """At the report's --tp 2 (the seed config's) and on one rank."""
    cuts = record_chunks(monkeypatch)
    engine = seed_engine(**{"parallel.tp_size": tp})
    try:
        arch = engine.engine.parts.runner.model.arch
        assert arch.architecture == "qwen3_next" and arch.sparse_layers
        replay_bug_1(engine)
    finally:
        engine.shutdown()
    # The report's scenario happened: a continuing chunk's budget ended off the grid ...
    assert any(limit % GRID for _, limit, _ in cuts), cuts
    # ... and every cut chunk still ended on it.
    assert all((start + length) % GRID == 0 for start, _, length in cuts), cuts


def test_red_the_reports_unaligned_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernel.scheduling.scheduler as sched_mod

    def unaligned(start: int, total: int, page_size: int, token_budget: int, owned_pages: int,
                  free_pages: int, grid: int | None = None) -> int:
        return max(min(total - start, token_budget, (owned_pages + free_pages) * page_size - start), 0)

    monkeypatch.setattr(sched_mod, "plan_chunk", unaligned)
    engine = seed_engine()
    try:
        with pytest.raises(AssertionError, match="off the grid|unaligned|covers|bit-exact"):
            replay_bug_1(engine)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()
