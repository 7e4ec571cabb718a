"""Aborts while speculating: a request cut off mid-stream (its consumer leaves) and others
aborted from outside while verify steps run give back every page, scratch row and state
slot (tests/leaks.py checks at shutdown), and the requests that go on are the plain
engine's, tokens and logprobs — dense and hybrid targets, chains and token trees,
deterministic mode.
"""

from __future__ import annotations

from typing import Any

import pytest

from kernel.async_engine import AsyncEngine
from kernel.sampling_params import SamplingParams
from tests.aborts import leave_and_abort, wait_idle
from tests.conftest import HYBRID_OVERRIDES, TINY_OVERRIDES
from tests.spec_drafters import Oracle
from tests.test_speculative import ORACLE, same
from tests.test_speculative_hybrid import tokens
from tests.test_speculative_tree import TREE

DRAFTERS = {"chain": ORACLE, "tree": TREE}
PARAMS = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "return_logprob": True}
MODELS = ("dense", "qwen3_5_text", "lfm2")


def settings(model: str, folders: dict[str, str]) -> dict[str, Any]:
    base = TINY_OVERRIDES if model == "dense" else HYBRID_OVERRIDES
    return {**base, "model.path": folders[model], "deterministic": True}


@pytest.fixture(scope="module")
def folders(tiny_chat_folder: str, hybrid_folders: dict[str, str]) -> dict[str, str]:
    return {"dense": tiny_chat_folder, **hybrid_folders}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("model", MODELS)
async def test_aborts_while_speculating(folders: dict[str, str], model: str, drafter: str) -> None:
    prompts = [tokens(60 + i, 9 + 3 * i) for i in range(4)]
    plain = await AsyncEngine.create(None, {**settings(model, folders), "cache.prefix": "none"})
    try:
        refs = [await plain.collect(plain.add_request(p, PARAMS)) for p in prompts]
    finally:
        await plain.shutdown()
    for prompt, ref in zip(prompts, refs):
        Oracle.answers[tuple(prompt)] = ref["output_ids"]
    engine = await AsyncEngine.create(None, {**settings(model, folders), **DRAFTERS[drafter]})
    try:
        keep = [engine.add_request(p, PARAMS) for p in prompts[:2]]
        cut = engine.add_request(prompts[2], PARAMS)
        outside = engine.add_request(prompts[3], SamplingParams(**PARAMS))
        aborted = await leave_and_abort(engine, cut, outside)
        assert aborted["meta_info"]["finish_reason"] == "abort"
        for rid, ref in zip(keep, refs):
            out = await engine.collect(rid)
            same(out, ref)
            assert out["meta_info"]["spec_accepted_tokens"] > 0
        await wait_idle(engine)
        sched = engine.scheduler
        assert sched.allocator.num_free + sched.prefix.cache.total_pages == sched.allocator.num_usable
        assert not any(r.spec_scratch_rows or r.verify_states or r.verify_side for r in sched.running)
    finally:
        await engine.shutdown()
