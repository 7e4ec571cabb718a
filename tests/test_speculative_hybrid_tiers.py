"""Speculation on hybrid models with prefix hits from the host tier and from storage,
deterministic mode: a first turn speculates (a chain, or a token tree), its output's
pages and the states its verify steps cached at grid points go to host and storage; a
next turn (the first turn's prompt and part of its answer, then new tokens) hits them —
once from host (every device page pushed out), once from storage (the tree emptied) —
and speculates again. Each output is `==` the plain engine's, tokens and logprobs, for
both families and every state strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kernel import Engine
from tests.test_host_tier_hybrid import INTERVAL
from tests.test_speculative import ORACLE, same
from tests.test_speculative_hybrid import STRATEGIES, make, reference, tokens
from tests.test_speculative_tree import TREE
from tests.test_storage_tier_hybrid import TIERED
from tests.test_tier_combos_hybrid import push_all_to_host

PROMPT = tokens(31, 3 * INTERVAL + 2)
PARAMS: list[dict[str, Any]] = [
    {"max_new_tokens": 3 * INTERVAL, "ignore_eos": True, "return_logprob": True, "temperature": 0},
    {"max_new_tokens": 2 * INTERVAL, "ignore_eos": True, "return_logprob": True, "temperature": 1.1,
     "seed": 11},
]
DRAFTERS = {"chain": ORACLE, "tree": TREE}


def hit(out: dict[str, Any], tier: str, at_least: int) -> None:
    tiers = out["meta_info"]["cached_tokens_by_tier"]
    assert tiers[tier] >= at_least and tiers["device"] == 0, f"not a {tier} hit past the first prompt: {tiers}"
    assert out["meta_info"]["spec_verify_ct"] > 0, "the next turn never speculated"


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_next_turn_from_host_and_storage(hybrid_ref: tuple[str, Engine], strategy: str, drafter: str,
                                         tmp_path: Path) -> None:
    folder, ref = hybrid_ref
    engine = make(folder, strategy, **TIERED, **DRAFTERS[drafter], **{"hicache.storage_dir": str(tmp_path)})
    try:
        first = reference(ref, PROMPT, PARAMS[0])
        out = engine.generate(PROMPT, PARAMS[0])
        same(out, first)  # type: ignore[arg-type]
        assert out["meta_info"]["spec_accepted_tokens"] > 0  # type: ignore[index,call-overload]
        turn = PROMPT + first["output_ids"][: 2 * INTERVAL + 3] + tokens(32, 3)
        want = reference(ref, turn, PARAMS[1])
        assert push_all_to_host(engine) > 0
        from_host = engine.generate(turn, PARAMS[1])
        same(from_host, want)  # type: ignore[arg-type]
        hit(from_host, "host", len(PROMPT) + INTERVAL)  # type: ignore[arg-type]
        assert engine.flush_cache()
        from_storage = engine.generate(turn, PARAMS[1])
        same(from_storage, want)  # type: ignore[arg-type]
        hit(from_storage, "storage", len(PROMPT) + INTERVAL)  # type: ignore[arg-type]
    finally:
        engine.shutdown()
