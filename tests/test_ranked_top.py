"""Top logprobs in one order whatever the batch asks: gpu/ranked_top.py. A request's reported
top logprobs must not depend on the requests batched beside it (deterministic mode's
promise), yet a batch takes as many as its most demanding row wants, and torch.topk orders
equal values (a grammar's ruled-out tokens, all -inf) differently for different k."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu.ranked_top import ranked_top


def reference(row: list[float], k: int) -> list[int]:
    """The definition: by value, largest first, equal values by ascending id."""
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]


def tied_rows(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-3, 3, (6, 300), generator=g).float()  # every value repeats ~50 times
    rows[0] = float("-inf")
    rows[0, 105] = 0.0  # a grammar allowing one token: the rest tie at -inf
    rows[1, ::2] = float("-inf")
    return rows


def check(rank: Any) -> None:
    for seed in range(3):
        rows = tied_rows(seed)
        for k in (1, 3, 4, 7, 20, 300):
            values, ids = rank(rows, k)
            for r in range(rows.shape[0]):
                want = reference(rows[r].tolist(), k)
                assert ids[r].tolist() == want, (seed, k, r)
                assert values[r].tolist() == rows[r, want].tolist()


def test_the_order_is_by_value_then_id_for_every_k() -> None:
    check(ranked_top)


def test_planted_ties_by_the_higher_id_red() -> None:
    """Planted: equal values ordered by descending id (another k-independent order, but not
    the defined one): the check goes red."""
    def higher_first(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        flipped = logprobs.flip(-1)
        values, ids = ranked_top(flipped, k)
        return values, logprobs.shape[-1] - 1 - ids

    with pytest.raises(AssertionError):
        check(higher_first)


def test_a_requests_top_logprobs_do_not_depend_on_its_batch(tiny_det_engine: Any) -> None:
    """Deterministic mode: a grammar-constrained request's top logprobs (most tokens -inf)
    read the same alone and batched beside a request that asks for more of them."""
    constrained = {"temperature": 0, "max_new_tokens": 6, "return_logprob": True, "top_logprobs_num": 3,
                   "regex": "(yes|no|maybe)( (yes|no|maybe)){0,4}"}
    other = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "return_logprob": True,
             "top_logprobs_num": 5}
    prompt, busy = "Is it raining? Answer:", "Once upon a time there was a little robot who"
    alone = tiny_det_engine.generate(prompt, constrained)
    batched = tiny_det_engine.generate([prompt, busy], [constrained, other])[0]
    tops = alone["meta_info"]["output_top_logprobs"]
    assert any(v is None or v == float("-inf") for step in tops for _, v in step), "no ruled-out token reported"
    assert batched["meta_info"]["output_top_logprobs"] == tops
    assert batched["output_ids"] == alone["output_ids"]
