"""Parity with transformers loading the same GGUF, teacher-forced (tests/numerics_compare.py):
transformers' greedy sequences scored by the engine (forward) and the engine's greedy
sequences scored by transformers (reverse), also for a prompt prefilled in chunks and for a
request served from the radix cache (reverse: the engine's own decode on the hit).

float32 on both sides, 16 greedy tokens a prompt. Measured on an AMD EPYC AVX2: mean / p99
|Δ logprob| 2.3e-6 / 1.0e-5 (forward, 105 positions), 1.8e-6 / 1.1e-5 (reverse, 64); chunked
cold run and radix hit (reverse) 1.6e-6 / 7.2e-6 and 2.4e-6 / 6.2e-6 (32 tokens: 1.9e-6 /
1.0e-5, 1.8e-6 / 1.0e-5, 1.0e-6 / 5.9e-6, 2.0e-6 / 7.8e-6). On an Intel Xeon AVX-512/BF16/AMX: 2.5e-6 /
1.1e-5 (forward), 1.9e-6 / 7.1e-6 (reverse), chunked and hit 3.1e-6 / 9.5e-6 and 3.3e-6 / 1.1e-5.
On an AMD EPYC AVX-512/BF16 (Zen 4, no AMX): 2.0e-6 / 1.1e-5 (forward), 2.0e-6 / 1.1e-5 (reverse),
chunked and hit 2.1e-6 / 8.8e-6 and 2.3e-6 / 8.5e-6 (kernels off: 1.9e-6 / 7.2e-6, 2.1e-6 / 9.7e-6,
2.1e-6 / 7.9e-6, 2.5e-6 / 1.2e-5).
Bounds (the old free-running one
was max 1e-3): mean |Δ logprob| < 1e-4, p99 < 1e-3, and the same top-1 wherever
transformers' top-2 margin exceeds 1e-2.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.conftest import CONFIG, TEST_OVERRIDES
from tests.numerics_compare import (
    TOP,
    Bounds,
    as_scored,
    check,
    check_report,
    evaluate,
    fixed_reference,
    hf_scorer,
    measure,
)

# SmolLM2 greedy decoding on both engines plus three scorings: on a small shared CPU this runs
# past the default per-test timeout (a safety net, not a bound: nothing here is timed).
pytestmark = pytest.mark.timeout(900)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived",
]
NEW_TOKENS = 16
PARAMS = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_logprob": True,
          "top_logprobs_num": TOP}
BOUNDS = Bounds(mean=1e-4, p99=1e-3, agreement=1.0, gap=1e-2)


def hf_greedy(model, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """Plain argmax decoding with transformers' own KV cache: no logits processors, so an
    EOS is just another token (the engine runs with ignore_eos)."""
    tokens: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(NEW_TOKENS):
            tokens.append(int(torch.argmax(out.logits[0, -1])))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_matches_transformers_teacher_forced(smollm_engine, hf_smollm) -> None:  # type: ignore[no-untyped-def]
    prompt_ids = [smollm_engine.tokenizer.encode(p) for p in PROMPTS]
    ref = fixed_reference(hf_scorer(hf_smollm), prompt_ids, [hf_greedy(hf_smollm, ids) for ids in prompt_ids], PARAMS)
    check_report(evaluate(smollm_engine, ref, BOUNDS.gap), BOUNDS)


def assert_matches_hf(model, ids: list[int], out: dict) -> None:  # type: ignore[no-untyped-def,type-arg]
    """The engine's own greedy tokens, scored by transformers (reverse)."""
    result = measure(hf_scorer(model)([ids + out["output_ids"]], [len(ids)]), [as_scored(out)], BOUNDS.gap)
    print(result)
    check(result, BOUNDS, "reverse (decode)")


# A prompt longer than three chunks of the engine below, so prefill is split.
LONG_PROMPT = (
    "The lighthouse keeper kept a careful log of every ship that passed the rocks, the weather "
    "at dawn and at dusk, and the oil he burned each night. "
) * 6 + "On the last page of the log he wrote"
CHUNK = 64


@pytest.fixture(scope="module")
def chunked_radix_engine() -> Iterator[object]:
    from kernel import Engine

    overrides = {**TEST_OVERRIDES, "cache.num_pages": 128, "cache.prefix": "radix",
                 "scheduler.chunked_prefill_size": CHUNK}
    engine = Engine(CONFIG, overrides)
    try:
        yield engine
    finally:
        engine.shutdown()


def test_chunked_prefill_and_radix_hit_match_transformers(chunked_radix_engine, hf_smollm) -> None:  # type: ignore[no-untyped-def]
    engine = chunked_radix_engine
    page = engine.config.cache.page_size
    ids = engine.tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 3 * CHUNK
    # Cold and chunked: ceil(len/CHUNK) prefill steps (the last samples the first token),
    # then one decode step per further token.
    steps = engine.engine.stats()["counters"]["steps"]
    first = engine.generate(ids, PARAMS)
    assert first["meta_info"]["cached_tokens"] == 0
    prefill_steps = -(-len(ids) // CHUNK)
    assert engine.engine.stats()["counters"]["steps"] - steps == prefill_steps + NEW_TOKENS - 1
    assert_matches_hf(hf_smollm, ids, first)
    # Second turn: its prefix (prompt and generated tokens) comes from the radix cache.
    ids2 = ids + first["output_ids"] + engine.tokenizer.encode(" Then he closed the book and said")
    second = engine.generate(ids2, PARAMS)
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["meta_info"]["cached_tokens"] >= len(ids) // page * page
    assert_matches_hf(hf_smollm, ids2, second)
    pages = engine.engine.stats()["pages"]
    assert pages["held"] == 0 and pages["evictable"] == pages["cached"] > 0
