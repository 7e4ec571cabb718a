"""A request decoded inside a batch of 16 concurrent requests of mixed lengths, while other
prompts are being chunked, agrees with the engine scoring its tokens alone, teacher-forced
(tests/numerics_compare.py: float32 both, measured mean |Δ logprob| 1.9e-6, max 1.3e-5 on
an AMD EPYC AVX2, 1.6e-6 and 9.4e-6 on an Intel Xeon AVX-512/BF16/AMX; bounds mean < 1e-5, p99 < 1e-4, every top-1 equal past a 1e-3 margin). Outside
deterministic mode the batch changes the rounding, so free-running tokens may part at a
near tie; tokens equal (==) whatever the batch is deterministic mode's promise
(tests/test_bit_exact.py)."""

from __future__ import annotations

import random

from tests.numerics_compare import TOP, Bounds, as_scored, check, measure, score

BOUNDS = Bounds(mean=1e-5, p99=1e-4, agreement=1.0, gap=1e-3)

TARGET = "Write a short poem about the sea and the wind."


def test_in_a_batch_of_16_agrees_with_alone(smollm_engine) -> None:  # type: ignore[no-untyped-def]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "return_logprob": True,
              "top_logprobs_num": TOP}
    rng = random.Random(7)
    # Mixed lengths; two prompts longer than chunked_prefill_size (512) are split into
    # chunks while the target decodes.
    lengths = [rng.randint(4, 100) for _ in range(13)] + [530, 700]
    others = [[rng.randint(100, 40000) for _ in range(n)] for n in lengths]
    prompts = others[:8] + [TARGET] + others[8:]
    other_params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs = smollm_engine.generate(prompts, [other_params] * 8 + [params] + [other_params] * 7)
    assert len(outs) == 16
    inside = outs[8]
    ids = smollm_engine.tokenizer.encode(TARGET)
    alone = score(smollm_engine, [ids + inside["output_ids"]], [len(ids)])
    result = measure(alone, [as_scored(inside)], BOUNDS.gap)
    print(result)
    check(result, BOUNDS, "in a batch vs alone")
