"""`speculative.acceptance: rejection` (opt-in) end to end: a sampled request's drafts are drawn
by the draft model from its own distribution and kept by the rejection rule (gpu/rejection.py;
that the rule keeps the target's distribution is tests/test_rejection_sampling.py's guard).
Here: a draft with the target's own weights has nearly every draft kept — where `exact`
acceptance keeps almost none, the two draws being independent — which holds only if each
verify row tests the draft at its own position against the distribution it was drawn from
(the planted misalignment goes red); greedy requests stay the plain engine's output exactly;
a seed reproduces its output; n-gram guesses (point masses) run too; trees are refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kernel import Engine
from kernel.config import ConfigError
from kernel.scheduling import step_loop
from tests.conftest import TINY_OVERRIDES
from tests.test_speculative import PARAMS, PROMPTS, same

SAMPLED = {"max_new_tokens": 24, "ignore_eos": True, "temperature": 1.0, "seed": 11}


def make(folder: str, acceptance: str, **extra: Any) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, "deterministic": True, "cache.prefix": "radix",
                         "speculative.method": "draft", "speculative.draft_model": folder,
                         "speculative.num_draft_tokens": 4, "speculative.acceptance": acceptance, **extra})


@pytest.fixture(scope="module")
def rejecting(tiny_chat_folder: str) -> Iterator[Engine]:
    engine = make(tiny_chat_folder, "rejection")
    yield engine
    engine.shutdown()


def kept_share(engine: Engine, seeds: range = range(6), prompts: list[list[int]] = PROMPTS) -> float:
    outs = engine.generate([prompts[i % len(prompts)] for i in range(len(seeds))], [{**SAMPLED, "seed": s} for s in seeds])
    assert isinstance(outs, list)
    drafted = sum(o["meta_info"]["spec_drafted_tokens"] for o in outs)
    assert drafted > 20, "too few drafts to judge"
    return sum(o["meta_info"]["spec_accepted_tokens"] for o in outs) / drafted


def test_same_weights_keep_nearly_every_draft(rejecting: Engine, tiny_chat_folder: str) -> None:
    share = kept_share(rejecting)
    assert share >= 0.9, f"rejection acceptance guard: {share:.2f} of the drafts kept"
    exact = make(tiny_chat_folder, "exact")
    try:
        assert kept_share(exact) < 0.5  # the target's own draw rarely repeats the draft's
    finally:
        exact.shutdown()


def test_planted_misaligned_distribution_red(rejecting: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row tests its draft against the next draft's distribution: kept far less often."""
    real = step_loop.draft_test

    def shifted(row: Any, ch: Any, j: int) -> Any:
        if ch.draft_probs is not None and j + 1 < len(ch.draft_probs):
            ch = ch._replace(draft_probs=(*ch.draft_probs[1:], ch.draft_probs[0]))
        return real(row, ch, j)

    monkeypatch.setattr(step_loop, "draft_test", shifted)
    with pytest.raises(AssertionError, match="rejection acceptance guard"):
        assert kept_share(rejecting, range(100, 106)) >= 0.9, "rejection acceptance guard: kept less"


def test_greedy_requests_stay_exact(rejecting: Engine, tiny_det_engine: Engine) -> None:
    greedy = [PARAMS[0], PARAMS[3]]  # greedy with top logprobs, greedy with logit_bias
    refs = tiny_det_engine.generate([PROMPTS[0], PROMPTS[3]], greedy)
    outs = rejecting.generate([PROMPTS[0], PROMPTS[3]], greedy)
    assert isinstance(outs, list) and isinstance(refs, list)
    for out, ref in zip(outs, refs):
        same(out, ref)


def test_a_seed_reproduces_its_output(rejecting: Engine) -> None:
    params = {**SAMPLED, "top_p": 0.9, "top_k": 50, "seed": 5, "return_logprob": True}
    first, again = (rejecting.generate(PROMPTS[1], params) for _ in range(2))
    assert first["output_ids"] == again["output_ids"]  # type: ignore[index]
    assert first["meta_info"]["spec_drafted_tokens"] > 0  # type: ignore[index]


def test_ngram_guesses(tiny_chat_folder: str, tiny_det_engine: Engine) -> None:
    """A point-mass q: a guess is kept with probability p(guess); greedy stays exact."""
    engine = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "deterministic": True,
                           "cache.prefix": "radix", "speculative.method": "ngram", "speculative.ngram_min": 1,
                           "speculative.acceptance": "rejection"})
    try:
        looped = PROMPTS[4] * 3  # repeats: something to look up
        out = engine.generate(looped, {**SAMPLED, "temperature": 0.3})
        assert out["meta_info"]["completion_tokens"] == SAMPLED["max_new_tokens"]  # type: ignore[index]
        same(engine.generate(looped, PARAMS[0]), tiny_det_engine.generate(looped, PARAMS[0]))  # type: ignore[arg-type]
    finally:
        engine.shutdown()


def test_trees_are_refused(tiny_chat_folder: str) -> None:
    with pytest.raises(ConfigError, match="acceptance: rejection verifies chains"):
        make(tiny_chat_folder, "rejection", **{"speculative.topk": 2})


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2"])
def test_hybrid_targets_and_drafts(hybrid_folders: dict[str, str], family: str) -> None:
    """A hybrid target verifying in one chunk (every position a sampling row) drafted by its own
    weights: the rows test the drafts at their own positions, so nearly every draft is kept
    (0.89-0.98 here, against 0.21-0.32 under exact acceptance: the draft's chunked and decode
    forms are not the target verify chunk's bits, and these tiny models' distributions are flat)."""
    from tests.test_speculative_hybrid import PROMPTS as HYBRID_PROMPTS
    from tests.test_speculative_hybrid import make as make_hybrid

    folder = hybrid_folders[family]
    engine = make_hybrid(folder, "extra_buffer", **{"speculative.method": "draft", "speculative.draft_model": folder,
                                                   "speculative.num_draft_tokens": 4,
                                                   "speculative.acceptance": "rejection"})
    try:
        share = kept_share(engine, prompts=HYBRID_PROMPTS)
        assert share >= 0.8, f"rejection acceptance guard: {share:.2f} of the drafts kept"
    finally:
        engine.shutdown()
