"""Greedy parity with transformers loading the same GGUF: tokens identical, logprobs within 1e-3."""

from __future__ import annotations

import pytest
import torch

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
