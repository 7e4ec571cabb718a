"""Speculation with everything else on: prefix hits from the host tier and from storage,
prompt logprobs, and retraction under page pressure — in deterministic mode the output is
the plain engine's, token for token and logprob for logprob, for a chain drafter and a
token tree (`tests.spec_drafters:Oracle` / `TreeOracle`, reference outputs with known
wrong guesses)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernel import Engine
from tests.conftest import TINY_OVERRIDES
from tests.spec_drafters import Oracle
from tests.test_host_tier import TIERED, settle
from tests.test_speculative import PARAMS, same, tokens

DRAFTERS = {
    "chain": {"speculative.method": "tests.spec_drafters:Oracle", "speculative.num_draft_tokens": 4},
    "tree": {"speculative.method": "tests.spec_drafters:TreeOracle", "speculative.num_draft_tokens": 4,
             "speculative.topk": 3},
}


@pytest.fixture(params=sorted(DRAFTERS))
def drafter(request: pytest.FixtureRequest) -> dict[str, Any]:
    return DRAFTERS[request.param]


def make(folder: str, drafter: dict[str, Any], **extra: Any) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, "deterministic": True, "cache.prefix": "radix",
                         **drafter, **extra})


def reference(det: Engine, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """The plain engine's output, which the Oracle then drafts (with its wrong guesses)."""
    out = det.generate(prompt, params)
    Oracle.answers[tuple(prompt)] = out["output_ids"]  # type: ignore[index,call-overload]
    return out  # type: ignore[return-value]


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.shutdown()


def test_host_tier_hit(tiny_chat_folder: str, tiny_det_engine: Engine, drafter: dict[str, Any],
                       engines: list[Engine]) -> None:
    """A speculating request's prefix pushed out to the host tier and loaded back."""
    engine = make(tiny_chat_folder, drafter, **TIERED)
    engines.append(engine)
    shared = tokens(1, 60)
    prompt = shared + tokens(2, 7)
    params = {**PARAMS[1], "max_new_tokens": 12}
    ref = reference(tiny_det_engine, prompt, params)
    reference(tiny_det_engine, shared, params)
    engine.generate(shared, params)  # cached on device, written through to host
    for i in range(5):  # fill the device pool: the shared prefix is evicted to host
        engine.generate(tokens(10 + i, 60), {**params, "max_new_tokens": 4})
        settle(engine)
    before = engine.engine.stats()["host"]["loaded_pages"]
    warm = engine.generate(prompt, params)
    assert engine.engine.stats()["host"]["loaded_pages"] > before, "no host hit"
    same(warm, ref)  # type: ignore[arg-type]
    assert warm["meta_info"]["spec_verify_ct"] > 0  # type: ignore[index,call-overload]


def test_storage_hit_on_speculated_output(tiny_chat_folder: str, tiny_det_engine: Engine, drafter: dict[str, Any],
                                          engines: list[Engine], tmp_path: Path) -> None:
    """A second turn whose prefix, speculated output included, comes from storage only."""
    engine = make(tiny_chat_folder, drafter, **TIERED, **{"hicache.storage": "file",
                                                          "hicache.storage_dir": str(tmp_path)})
    engines.append(engine)
    first = tokens(3, 30)
    params = {**PARAMS[0], "max_new_tokens": 24}
    turn1 = engine.generate(first, params)
    same(turn1, reference(tiny_det_engine, first, params))  # type: ignore[arg-type]
    turn2 = first + turn1["output_ids"] + tokens(4, 5)  # type: ignore[index,call-overload]
    ref = reference(tiny_det_engine, turn2, PARAMS[2])
    assert engine.flush_cache()  # the tree is emptied: what the turn reuses is in storage
    warm = engine.generate(turn2, PARAMS[2])
    tiers = warm["meta_info"]["cached_tokens_by_tier"]  # type: ignore[index,call-overload]
    assert tiers["storage"] > len(first) and tiers["device"] == 0, tiers
    same(warm, ref)  # type: ignore[arg-type]


def test_prompt_logprobs(tiny_chat_folder: str, tiny_det_engine: Engine, drafter: dict[str, Any],
                         engines: list[Engine]) -> None:
    """Prompt logprobs in the same batch as verify steps (and of a speculating request)."""
    engine = make(tiny_chat_folder, drafter)
    engines.append(engine)
    prompts = [tokens(20, 17), tokens(21, 30)]
    params = [{**PARAMS[0], "logprob_start_len": 0}, PARAMS[1]]
    refs = [reference(tiny_det_engine, p, q) for p, q in zip(prompts, params)]
    outs = engine.generate(prompts, params)
    assert isinstance(outs, list)
    for out, ref in zip(outs, refs):
        same(out, ref)
    assert outs[0]["meta_info"]["input_token_logprobs"] == refs[0]["meta_info"]["input_token_logprobs"]
    assert outs[0]["meta_info"]["spec_verify_ct"] > 0


def test_retraction_under_page_pressure(tiny_chat_folder: str, tiny_det_engine: Engine, drafter: dict[str, Any],
                                        engines: list[Engine]) -> None:
    """Requests retracted while speculating recompute and still give the plain output."""
    prompts = [tokens(30 + i, 10 + i) for i in range(6)]
    params = {**PARAMS[0], "max_new_tokens": 30}
    refs = [reference(tiny_det_engine, p, params) for p in prompts]
    # 24 usable pages of 4 tokens = 96 tokens for 6 requests that grow to ~42 tokens each.
    engine = make(tiny_chat_folder, drafter, **{"cache.num_pages": 25})
    engines.append(engine)
    outs = engine.generate(prompts, params)
    assert isinstance(outs, list)
    assert engine.engine.scheduler.num_retractions > 0
    for out, ref in zip(outs, refs):
        same(out, ref)
    assert sum(out["meta_info"].get("spec_verify_ct", 0) for out in outs) > 0
