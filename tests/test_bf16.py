"""`model.dtype: bfloat16` end to end (it crashed on the first step: RoPE tables in float32
promoted k to float32 before the bf16 KV write). Against the float32 engine on the
packaged SmolLM2: greedy tokens agree on a fixed prompt set for the first tokens, and
the chosen tokens' logprobs stay within a bound measured on this machine (max 0.14 over
the agreeing prefix of 16 tokens; the bound leaves room for other CPUs' bf16 kernels).
"""

from __future__ import annotations

from typing import Any

from kernel import Engine
from tests.conftest import CONFIG, TEST_OVERRIDES

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]
PARAMS = {"max_new_tokens": 16, "temperature": 0, "return_logprob": True}
AGREE = 5  # greedy tokens that must be identical
BOUND = 0.25


def logprobs(out: dict[str, Any]) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def test_bf16_agrees_with_float32(smollm_engine: Engine) -> None:
    ref = smollm_engine.generate(PROMPTS, PARAMS)
    bf16 = Engine(CONFIG, {**TEST_OVERRIDES, "model.dtype": "bfloat16"})
    try:
        got = bf16.generate(PROMPTS, PARAMS)
    finally:
        bf16.shutdown()
    for a, b in zip(ref, got):  # type: ignore[arg-type]
        assert b["output_ids"][:AGREE] == a["output_ids"][:AGREE]
        n = next((i for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y), 16)
        worst = max(abs(x - y) for x, y in zip(logprobs(a)[:n], logprobs(b)[:n]))
        assert worst < BOUND, (n, worst)
