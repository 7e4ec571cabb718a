"""Prompt logprobs through the offline Engine on the tiny model: every scored position
across chunk boundaries equals transformers' full forward; in deterministic mode a
cache hit (the match capped at the first scored position) gives values `==` to a cold
run, and so do other chunk slicings, the lm_head slice size and the graph runner (whose
decode steps replay graphs; prompt-logprob chunks run eagerly).
Planted bugs (match not capped, capped one token too far, targets off by one) go red.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import gpu.prompt_logprobs as device_side
import kernel.scheduling.prompt_logprobs as kernel_side
import tests.test_bit_exact as bit_exact
from kernel import Engine
from kernel.scheduling import prefix_reuse
from tests import leaks
from tests.conftest import (
    GRAPHS_EMULATE,
    HYBRID_FAMILIES,
    HYBRID_OVERRIDES,
    TINY_OVERRIDES,
    assert_replayed,
    graph_replays,
)

make = bit_exact.make
det = bit_exact.det  # the fixture: a deterministic radix engine on the tiny chat model
PAGE = TINY_OVERRIDES["cache.page_size"]
CHUNK = TINY_OVERRIDES["scheduler.chunked_prefill_size"]


def prompt(seed: int, n: int, vocab: int = 40000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, vocab - 1) for _ in range(n)]


IDS = prompt(1, 2 * CHUNK + 11)  # three prefill chunks


def score(engine: Engine, ids: list[int], start: int, **extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": start, **extra}
    out = engine.generate(ids, params)
    assert isinstance(out, dict)
    return out


def values(out: dict[str, Any]) -> list[float | None]:
    return [lp for lp, _ in out["meta_info"]["input_token_logprobs"]]


def reference(folder: str, ids: list[int]) -> list[float]:
    """transformers: logprob of token p (p >= 1) from the full forward's logits at p - 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


@pytest.fixture(scope="module")
def ref(tiny_chat_folder: str) -> list[float]:
    return reference(tiny_chat_folder, IDS)


def assert_close(ours: list[float | None], ref: list[float]) -> None:
    """The guard against transformers; its message lets the planted-bug test say it fired."""
    assert len(ours) == len(ref), f"prompt-logprob guard: {len(ours)} values, transformers {len(ref)}"
    worst = max(abs(a - b) for a, b in zip(ours, ref, strict=True) if a is not None)
    assert worst < 1e-4, f"prompt-logprob guard: {worst:.3g} off transformers"


@pytest.mark.parametrize("start", [0, 1, 5, CHUNK, CHUNK + 1, 2 * CHUNK, len(IDS) - 1])
def test_every_scored_position_matches_transformers(tiny_engine: Engine, ref: list[float], start: int) -> None:
    out = score(tiny_engine, IDS, start, top_logprobs_num=3)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"] == "length"
    assert [t for _, t in meta["input_token_logprobs"]] == IDS[start:]
    ours = values(out)
    if start == 0:  # the first prompt token has no logprob
        assert ours[0] is None and meta["input_top_logprobs"][0] is None
        ours = ours[1:]
    assert_close(ours, ref[max(start, 1) - 1 :])
    for top, lp in zip(meta["input_top_logprobs"][start == 0 :], ours, strict=True):
        assert len(top) == 3 and top[0][0] >= top[1][0] >= top[2][0] and lp <= top[0][0]


def test_with_generation_and_batched(tiny_engine: Engine, ref: list[float]) -> None:
    """Scoring and generating in one request, next to a plain request in the same batch."""
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    alone = tiny_engine.generate(IDS[:20], params)
    both = tiny_engine.generate([IDS, IDS[:20]], [{**params, "logprob_start_len": 0}, params])
    assert isinstance(both, list) and isinstance(alone, dict)
    assert len(both[0]["output_ids"]) == 3 and both[1]["output_ids"] == alone["output_ids"]
    assert "input_token_logprobs" not in both[1]["meta_info"]
    assert_close(values(both[0])[1:], ref)


def test_cache_hit_equals_cold_run(det: Engine) -> None:
    ids = prompt(2, 2 * CHUNK + 7)
    cold = values(score(det, ids, 0))
    assert score(det, ids, 0)["meta_info"]["cached_tokens"] == 0  # start 0: nothing may be matched
    for start in (2 * PAGE, 2 * PAGE + 1, CHUNK + 3, len(ids) - 1):
        warm = score(det, ids, start)
        cap = (max(start, 1) - 1) // PAGE * PAGE
        assert warm["meta_info"]["cached_tokens"] == cap > 0
        assert values(warm) == cold[start:]
    # A prompt sharing a prefix: its scored tokens inside the shared part are equal too.
    other = ids[: CHUNK + 5] + prompt(3, 9)
    warm = score(det, other, CHUNK)
    assert warm["meta_info"]["cached_tokens"] > 0
    assert values(warm)[:5] == cold[CHUNK : CHUNK + 5]


def test_chunking_and_slicing_do_not_change_values(
    det: Engine, tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cold = values(score(det, IDS, 0))
    monkeypatch.setattr(device_side, "SLICE_ROWS", 5)  # the lm_head in slices of 5 rows
    assert values(score(det, IDS, 0)) == cold
    engine = make(tiny_chat_folder, **{"scheduler.chunked_prefill_size": 8, "scheduler.max_num_batched_tokens": 16})
    try:
        assert values(score(engine, IDS, 0)) == cold
    finally:
        engine.shutdown()


def test_graphs_do_not_change_values(det: Engine, tiny_chat_folder: str) -> None:
    """Prefill chunks with prompt logprobs run eagerly though a bucket holds them (no graph
    keeps their span rows); the decode steps after them replay graphs. Both `==` graphs off."""
    gen = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    want = score(det, IDS, 0, **gen)
    engine = make(tiny_chat_folder, **GRAPHS_EMULATE)
    try:
        before = graph_replays(engine)
        got = score(engine, IDS, 0, **gen)
        assert graph_replays(engine)["prefill"] == before["prefill"], "a prompt-logprob chunk ran in a graph"
        assert_replayed(engine, before, ("decode",))
    finally:
        engine.shutdown()
    assert values(got) == values(want)
    assert got["output_ids"] == want["output_ids"] and bit_exact.logprobs(got) == bit_exact.logprobs(want)


def test_device_side_gathers_the_span_rows_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spans over two chunks of a flat batch, against log_softmax of every row."""
    monkeypatch.setattr(device_side, "SLICE_ROWS", 3)
    torch.manual_seed(0)
    hidden, extend = torch.randn(12, 50), [5, 7]
    spans = [device_side.PromptLogprobSpan(0, 1, (4, 9, 11), 2), device_side.PromptLogprobSpan(1, 2, (0, 49), 0)]
    out = device_side.prompt_logprobs(lambda rows: rows * 2, hidden, spans, extend)
    full = torch.log_softmax(hidden * 2, -1)
    for span, result, rows in zip(spans, out, ([1, 2, 3], [7, 8]), strict=True):
        want = [full[r, t].item() for r, t in zip(rows, span.targets, strict=True)]
        assert result.logprobs == want
        assert result.ranks == [int((full[r] > full[r, t]).sum()) + 1 for r, t in zip(rows, span.targets, strict=True)]
        assert result.top == ([[(int(i), full[r, i].item()) for i in full[r].topk(2).indices] for r in rows]
                              if span.top_n else [[] for _ in rows])
    with pytest.raises(ValueError, match="outside its chunk"):
        device_side.span_rows([device_side.PromptLogprobSpan(0, 4, (1, 2), 0)], extend)


# ---- planted bugs: the guards go red ------------------------------------------------
def warm_run_fails(folder: str, ids: list[int], start: int) -> None:
    engine = make(folder)
    try:
        score(engine, ids, 0)  # caches the whole prompt
        with pytest.raises(Exception, match="never computed"):
            score(engine, ids, start)
    finally:
        leaks.excuse(engine.engine)  # the guard halted it on purpose
        engine.shutdown()


def test_red_match_not_capped(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_reuse, "match_cap", lambda req: None)
    warm_run_fails(tiny_chat_folder, prompt(4, 40), 3 * PAGE)


def test_red_match_capped_one_token_too_far(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The logits that score token k sit at position k - 1: a cap at k loses them when k is a page multiple.
    monkeypatch.setattr(prefix_reuse, "match_cap", kernel_side.first_scored)
    warm_run_fails(tiny_chat_folder, prompt(4, 40), 3 * PAGE)


def test_red_targets_off_by_one(tiny_engine: Engine, ref: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    real = kernel_side.chunk_span

    def shifted(index: int, req: Any, start: int, length: int) -> Any:
        span = real(index, req, start, length)
        if span is None:
            return None
        first = start + span.offset  # the target is the token at the position itself
        return span._replace(targets=tuple(req.prompt_ids[first : first + len(span.targets)]))

    monkeypatch.setattr(kernel_side, "chunk_span", shifted)
    with pytest.raises(AssertionError, match="prompt-logprob guard: .* off transformers"):
        assert_close(values(score(tiny_engine, IDS, 0))[1:], ref)


# ---- hybrid models and retraction ---------------------------------------------------
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_cache_hit_equals_cold_run(hybrid_folders: dict[str, str], family: str) -> None:
    """The match of a hybrid model ends at a cached state at or before the cap."""
    engine = Engine(None, {**HYBRID_OVERRIDES, "model.path": hybrid_folders[family], "deterministic": True})
    try:
        ids = prompt(5, 2 * CHUNK + 3, engine.engine.info.vocab_size)
        cold = values(score(engine, ids, 0))
        assert len(cold) == len(ids) and all(v is not None for v in cold[1:])
        for start in (CHUNK + 1, len(ids) - 2):
            warm = score(engine, ids, start)
            assert 0 < warm["meta_info"]["cached_tokens"] <= start - 1
            assert values(warm) == cold[start:]
    finally:
        engine.shutdown()


def test_retracted_requests_score_their_prompt_again(tiny_chat_folder: str, det: Engine) -> None:
    """A pool too small for all of them: requests are retracted mid-way and recomputed;
    their prompt logprobs are each as alone (the list starts afresh, nothing doubled)."""
    prompts = [prompt(10 + i, 30 + 5 * i) for i in range(4)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "return_logprob": True,
              "logprob_start_len": 0}
    alone = [values(det.generate(p, params)) for p in prompts]  # type: ignore[arg-type]
    engine = make(tiny_chat_folder, **{"cache.num_pages": 33, "cache.prefix": "none"})
    try:
        outs = engine.generate(prompts, params)
        assert engine.engine.scheduler.num_retractions > 0
    finally:
        engine.shutdown()
    assert [values(o) for o in outs] == alone  # type: ignore[union-attr]
