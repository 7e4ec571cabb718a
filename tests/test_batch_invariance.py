"""A request's greedy output is the same alone and inside a batch of 16 concurrent
requests of mixed lengths, while other prompts are being chunked."""

from __future__ import annotations

import random

TARGET = "Write a short poem about the sea and the wind."


def test_alone_equals_in_batch_of_16(smollm_engine) -> None:  # type: ignore[no-untyped-def]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    alone = smollm_engine.generate(TARGET, params)
    rng = random.Random(7)
    # Mixed lengths; two prompts longer than chunked_prefill_size (512) are split into
    # several chunks while the target decodes.
    lengths = [rng.randint(4, 200) for _ in range(13)] + [700, 900]
    others = [[rng.randint(100, 40000) for _ in range(n)] for n in lengths]
    prompts = others[:8] + [TARGET] + others[8:]
    other_params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs = smollm_engine.generate(prompts, [other_params] * 8 + [params] + [other_params] * 7)
    assert len(outs) == 16
    inside = outs[8]
    assert inside["output_ids"] == alone["output_ids"]
    a = [lp for lp, _ in alone["meta_info"]["output_token_logprobs"]]
    b = [lp for lp, _ in inside["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
