"""Compare an engine's greedy outputs with the float32 engine's on a fixed prompt set:
where they first diverge, how many tokens agree, and the largest logprob difference of
the chosen tokens before the first divergence (after it the contexts differ)."""

from __future__ import annotations

from typing import Any, NamedTuple

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "import numpy as np\n\n# compute the mean of a list\ndef mean(xs):",
    "<|im_start|>user\nName a planet in the solar system.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at a temperature of",
]
NEW_TOKENS = 32
PARAMS = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_logprob": True}


class Agreement(NamedTuple):
    first_divergence: list[int]  # per prompt; NEW_TOKENS where all agree
    agreement: float  # fraction of tokens before the first divergence, over all prompts
    max_logprob_error: float  # chosen tokens' |logprob - reference| before the divergence

    def __str__(self) -> str:
        return (f"first divergence {self.first_divergence}, agreement {self.agreement:.3f}, "
                f"max logprob error {self.max_logprob_error:.4f}")


def logprobs(out: dict[str, Any]) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> Agreement:
    firsts, worst = [], 0.0
    for a, b in zip(ref, got):
        ids_a, ids_b = a["output_ids"], b["output_ids"]
        n = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
        firsts.append(n)
        # Position n itself is where the two distributions disagree on the argmax: its
        # logprobs are still of the same context, so they count.
        m = min(n + 1, len(ids_a), len(ids_b))
        errs = [abs(x - y) for x, y in zip(logprobs(a)[:m], logprobs(b)[:m])]
        worst = max([worst, *errs])
    return Agreement(firsts, sum(firsts) / (NEW_TOKENS * len(ref)), worst)
