"""Speculative decoding at tensor parallelism: drafts are made on rank 0 (a draft model is
whole there, with no collectives), a verify step is one more batch every rank runs, and a
token tree's accepted side KV moves on every rank. In deterministic mode a speculating
engine at tp_size 2 equals a plain one at tp_size 2, token for token and logprob for
logprob: chains, token trees, n-gram drafts, a draft model and a hybrid model. Planted: the
side KV moved on rank 0 only goes red."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kernel import Engine
from kernel.parallel.workers import TensorParallelRunner
from tests.spec_drafters import Oracle
from tests.test_speculative import ORACLE, PARAMS, PROMPTS, answers, same
from tests.test_speculative_tree import TREE
from tests.test_tensor_parallel import engine, outputs
from tests.tiny_hybrid import build_tiny_qwen3_5

DET = {"deterministic": True, "cache.prefix": "radix"}
NGRAM = {"speculative.method": "ngram", "speculative.num_draft_tokens": 4}


@pytest.fixture(scope="module")
def refs(tiny_chat_folder: str) -> list[dict[str, Any]]:
    """The plain engine's outputs at tp_size 2, which the oracles then draft."""
    outs = outputs(engine(tiny_chat_folder, 2, **DET), PROMPTS, PARAMS)
    answers(outs)
    return outs


def spec_stats(e: Engine) -> dict[str, Any]:
    stats = e.engine.stats()["speculative"]
    assert stats is not None
    return stats  # type: ignore[no-any-return]


@pytest.mark.parametrize("drafter", ["chain", "tree"])
def test_speculating_at_tp2_equals_plain_tp2(tiny_chat_folder: str, refs: list[dict[str, Any]], drafter: str) -> None:
    answers(refs)
    e = engine(tiny_chat_folder, 2, **DET, **(ORACLE if drafter == "chain" else TREE))
    try:
        outs = e.generate(PROMPTS, PARAMS)
        stats = spec_stats(e)
    finally:
        e.shutdown()
    assert isinstance(outs, list)
    for out, ref in zip(outs, refs):
        same(out, ref)
    assert stats["accepted_tokens"] > 0
    if drafter == "tree":
        assert stats["side_accepted_tokens"] > 0, "no side path accepted: the KV move went untested"


def test_ngram_and_draft_model_at_tp2(tiny_chat_folder: str) -> None:
    prompt = [[5, 6, 7, 8, 9, 10] * 6, [11, 12, 13] * 9]
    params = [{"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "return_logprob": True}] * 2
    plain = outputs(engine(tiny_chat_folder, 2, **DET), prompt, params)
    draft = {"speculative.method": "draft", "speculative.draft_model": tiny_chat_folder,
             "speculative.num_draft_tokens": 3}
    for drafter in (NGRAM, draft):
        for out, ref in zip(outputs(engine(tiny_chat_folder, 2, **DET, **drafter), prompt, params), plain):
            same(out, ref)


def test_hybrid_speculating_at_tp2_equals_plain_tp2(tmp_path: Path) -> None:
    folder = str(build_tiny_qwen3_5(tmp_path))
    extra = {**DET, "cache.state_track_interval": 16, "cache.page_size": 16}
    prompts = [[(7 * i + 3) % 300 + 3 for i in range(40)], [9, 8, 7, 6, 5]]
    params = [{"max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "return_logprob": True},
              {"max_new_tokens": 30, "temperature": 1.2, "seed": 4, "ignore_eos": True, "return_logprob": True}]
    plain = outputs(engine(folder, 2, **extra), prompts, params)
    for prompt, out in zip(prompts, plain):
        Oracle.answers[tuple(prompt)] = out["output_ids"]
    for out, ref in zip(outputs(engine(folder, 2, **extra, **ORACLE), prompts, params), plain):
        same(out, ref)


def test_red_side_kv_moved_on_rank0_only(tiny_chat_folder: str, refs: list[dict[str, Any]],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers keep an accepted side path's KV on its scratch slots: red."""
    from gpu.model_runner import ModelRunner

    answers(refs)
    monkeypatch.setattr(TensorParallelRunner, "move_kv", ModelRunner.move_kv)
    e = engine(tiny_chat_folder, 2, **DET, **TREE)
    try:
        outs = e.generate(PROMPTS, PARAMS)
    finally:
        e.shutdown()
    assert isinstance(outs, list)
    with pytest.raises(AssertionError, match="speculation guard"):
        for out, ref in zip(outs, refs):
            same(out, ref)
