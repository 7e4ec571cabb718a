"""Hybrid models served by the engine: logprobs match transformers teacher-forced with and
without the prefix cache; running out of state slots is a wait (counted), never a crash."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernel import Engine
from tests.conftest import HYBRID_FAMILIES, HYBRID_OVERRIDES
from tests.hybrid_driver import reference_generate
from tests.numerics_compare import TOP, Bounds, check_report, evaluate, fixed_reference, hf_scorer, reference
from tests.tiny_hybrid import VOCAB

NUM_DECODE = 16
PROMPTS = [[(5 * j + 11 * i + 3) % VOCAB for j in range(n)] for i, n in enumerate((45, 19, 70))]
GREEDY = {"max_new_tokens": NUM_DECODE, "temperature": 0, "ignore_eos": True, "return_logprob": True,
          "top_logprobs_num": TOP}
# float32 on both sides: teacher-forced (tests/numerics_compare.py), the engine's greedy
# sequences scored by transformers and transformers' by the engine. Measured on an AMD EPYC
# AVX2 (model.cpu_kernels auto and off alike): mean |Δ logprob| <= 3.4e-6, p99 <= 3.2e-5; on
# an Intel Xeon AVX-512/BF16/AMX: mean <= 3.4e-6, p99 <= 3.4e-5, max 4.1e-5.
BOUNDS = Bounds(mean=1e-4, p99=1e-3, agreement=1.0, gap=1e-2)


@pytest.fixture(scope="module")
def references(hybrid_folders: dict[str, str]) -> dict[str, list[Any]]:
    return {name: reference_generate(folder, PROMPTS, NUM_DECODE) for name, folder in hybrid_folders.items()}


@pytest.mark.parametrize("prefix", ["none", "radix"])
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_matches_transformers(
    hybrid_folders: dict[str, str], references: dict[str, list[Any]], family: str, prefix: str
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hybrid_folders[family], dtype=torch.float32).eval()
    ref = fixed_reference(hf_scorer(model), PROMPTS, [ids for ids, _ in references[family]], GREEDY)
    engine = Engine(None, {**HYBRID_OVERRIDES, "model.path": hybrid_folders[family], "cache.prefix": prefix})
    try:
        for _ in range(2):  # the second round hits the cache when it is on
            report = evaluate(engine, ref, BOUNDS.gap)
            check_report(report, BOUNDS)
        hits = [o["meta_info"]["cached_tokens"] for o in report.outputs]
        assert (sum(hits) > 0) == (prefix == "radix"), hits
    finally:
        engine.shutdown()


def count_slot_waits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per admission the scheduler held back for lack of state slots."""
    from kernel.states.hybrid_state import HybridState

    real, waits = HybridState.can_admit, []

    def counting(self: HybridState) -> bool:
        ok = real(self)
        if not ok:
            waits.append(1)
        return ok

    monkeypatch.setattr(HybridState, "can_admit", counting)
    return waits


def slots_run(folder: str, strategy: str, waits: list[int]) -> None:
    """6 requests on 3 usable slots: all finish, each agreeing (teacher-forced) with an engine
    that has room, and some waited."""
    small = Engine(None, {**HYBRID_OVERRIDES, "model.path": folder, "cache.state_slots": 4,
                          "cache.state_strategy": strategy})
    roomy = Engine(None, {**HYBRID_OVERRIDES, "model.path": folder, "cache.prefix": "none"})
    try:
        prompts = [PROMPTS[i % 3][: 20 + 7 * i] for i in range(6)]
        report = evaluate(small, reference(roomy, prompts, GREEDY), BOUNDS.gap)
        assert all(len(o["output_ids"]) == NUM_DECODE for o in report.outputs)
        check_report(report, BOUNDS)
    finally:
        small.shutdown()
        roomy.shutdown()
    assert waits, "slot-wait guard: no request waited for a state slot"


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_out_of_state_slots_is_a_wait(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """3 usable slots: at most one or two requests run at once; the others wait, all finish, correct."""
    slots_run(hybrid_folders["qwen3_5_text"], strategy, count_slot_waits(monkeypatch))


def test_red_state_slots_setting_ignored(hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the state pool sized by the default, not cache.state_slots: nothing waits."""
    from kernel import components

    real = components.StatePool
    monkeypatch.setattr(components, "StatePool", lambda shapes, num, *rest: real(shapes, 64, *rest))
    with pytest.raises(AssertionError, match="slot-wait guard: no request waited for a state slot"):
        slots_run(hybrid_folders["qwen3_5_text"], "extra_buffer", count_slot_waits(monkeypatch))


def test_truncated_hits_are_counted(hybrid_folders: dict[str, str]) -> None:
    """A prompt whose cached KV runs past its last cached state: the hit resumes at the
    state, and the engine counts the tokens it could not use."""
    interval = HYBRID_OVERRIDES["cache.state_track_interval"]
    engine = Engine(None, {**HYBRID_OVERRIDES, "model.path": hybrid_folders["lfm2"],
                           "scheduler.chunked_prefill_size": interval})  # a checkpoint per chunk
    try:
        prompt = PROMPTS[2][: 3 * interval + 2]
        engine.generate(prompt, {**GREEDY, "max_new_tokens": 1})  # states at 8, 16, 24
        stats = engine.engine.stats()
        assert stats["cache"]["cached_states"] == 3 and stats["states"]["held"] == 0
        # A prompt sharing 2.5 checkpoint intervals: its KV matches 20 tokens, the
        # deepest state is at 16.
        branch = prompt[: 2 * interval + 4] + [7, 8, 9, 10, 11, 12]
        out = engine.generate(branch, {**GREEDY, "max_new_tokens": 1})
        assert out["meta_info"]["cached_tokens"] == 2 * interval  # type: ignore[call-overload]
        assert engine.engine.cache_stats()["prefix_truncated_tokens"] == 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("strategy,states", [("no_buffer", 1), ("extra_buffer", 3), ("extra_buffer_lazy", 3)])
def test_checkpoints_inside_a_prefill_chunk(hybrid_folders: dict[str, str], strategy: str, states: int) -> None:
    """One 32-token chunk covers the grid points 8, 16, 24: the buffered strategies have
    the forward write all three (no copies); no_buffer can only copy the live state at
    the chunk's end. A prompt that branches off at 20 resumes at 16 where there is one."""
    interval = HYBRID_OVERRIDES["cache.state_track_interval"]
    engine = Engine(None, {**HYBRID_OVERRIDES, "model.path": hybrid_folders["qwen3_5_text"],
                           "cache.state_strategy": strategy, "scheduler.chunked_prefill_size": 32})
    try:
        prompt = PROMPTS[2][: 3 * interval + 3]
        engine.generate(prompt, {**GREEDY, "max_new_tokens": 1})
        assert engine.engine.cache_stats()["cached_states"] == states
        branch = prompt[:20] + [9, 9, 9, 9]
        out = engine.generate(branch, {**GREEDY, "max_new_tokens": 1})
        assert out["meta_info"]["cached_tokens"] == (16 if states == 3 else 0)  # type: ignore[call-overload]
        assert engine.engine.stats()["states"]["held"] == 0
    finally:
        engine.shutdown()


def test_snapshot_and_kv_events_show_which_nodes_hold_state(hybrid_folders: dict[str, str]) -> None:
    from cache.kv_events import StateStored, page_hashes

    engine = Engine(None, {**HYBRID_OVERRIDES, "model.path": hybrid_folders["lfm2"]})
    events: list[object] = []
    try:
        unsubscribe = engine.engine.subscribe_kv_events(events.extend)
        assert unsubscribe is not None
        prompt = PROMPTS[0][:27]
        engine.generate(prompt, {**GREEDY, "max_new_tokens": 1})
        stored = [e for e in events if isinstance(e, StateStored)]
        # extra_buffer: checkpoints at 8, 16, 24, each named by its last page's chain hash
        hashes = page_hashes(prompt, HYBRID_OVERRIDES["cache.page_size"])
        assert [(e.num_tokens, e.block_hash) for e in stored] == [(n, hashes[n // 4 - 1]) for n in (8, 16, 24)]
        nodes = engine.engine.snapshot()
        assert sorted(n["state_len"] for n in nodes if n["state_slot"] is not None) == [8, 16, 24]
        unsubscribe()
    finally:
        engine.shutdown()
