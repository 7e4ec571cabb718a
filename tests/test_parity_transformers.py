"""Greedy parity with transformers loading the same GGUF: tokens identical, logprobs within 1e-3,
also for a prompt prefilled in chunks and for a request served from the radix cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.conftest import CONFIG, TEST_OVERRIDES

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived",
]
NEW_TOKENS = 32


def hf_greedy(model, ids: list[int]) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    """Plain argmax decoding with transformers' own KV cache: no logits processors, so an
    EOS is just another token (the engine runs with ignore_eos)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(NEW_TOKENS):
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            tok = int(torch.argmax(logp))
            tokens.append(tok)
            logprobs.append(logp[tok].item())
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(smollm_engine, hf_smollm, prompt: str) -> None:  # type: ignore[no-untyped-def]
    ids = smollm_engine.tokenizer.encode(prompt)
    ref_tokens, ref_logprobs = hf_greedy(hf_smollm, ids)
    out = smollm_engine.generate(
        ids, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    )
    assert out["output_ids"] == ref_tokens
    ours = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-3


# A prompt longer than three chunks of the engine below, so prefill is split.
LONG_PROMPT = (
    "The lighthouse keeper kept a careful log of every ship that passed the rocks, the weather "
    "at dawn and at dusk, and the oil he burned each night. "
) * 6 + "On the last page of the log he wrote"
CHUNK = 64
PARAMS = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_logprob": True}


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


def assert_matches_hf(out: dict, ref_tokens: list[int], ref_logprobs: list[float]) -> None:  # type: ignore[type-arg]
    assert out["output_ids"] == ref_tokens
    ours = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-3


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
    assert_matches_hf(first, *hf_greedy(hf_smollm, ids))
    # Second turn: its prefix (prompt and generated tokens) comes from the radix cache.
    ids2 = ids + first["output_ids"] + engine.tokenizer.encode(" Then he closed the book and said")
    second = engine.generate(ids2, PARAMS)
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["meta_info"]["cached_tokens"] >= len(ids) // page * page
    assert_matches_hf(second, *hf_greedy(hf_smollm, ids2))
    pages = engine.engine.stats()["pages"]
    assert pages["held"] == 0 and pages["evictable"] == pages["cached"] > 0
