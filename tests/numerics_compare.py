"""Teacher-forced numerics: how far an engine's logprobs are from a reference's, on the
reference's own tokens, so that every position is compared in the same context.

Free-running greedy agreement (how many tokens two engines generate alike) is chaotic: two
tokens that nearly tie flip on the last bit of rounding, the contexts part and nothing
after is comparable, so a bound tuned on one CPU fails on the next. What is stable across
CPUs is measured instead, position by position on one fixed token sequence:

- mean and p99 of |Δ logprob| of the sequence's tokens over all scored positions;
- top-1 agreement over the positions where the reference's top-2 margin exceeds a stated
  gap (a near tie may flip; a clear winner may not).

Two directions, both through the engine's prompt logprobs (`logprob_start_len`):
- `forward`: the reference's greedy sequences (prompt + output) scored by the engine
  tested, every token from position 1 (its prefill path);
- `reverse`: the engine tested generates greedily; the reference scores that engine's own
  sequences, and the tested engine's output logprobs (its decode path) are compared with
  those scores.
The free-running agreement is printed (`FreeRunning`), never asserted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

# Six prompts of 24 greedy tokens: ~200 scored positions a direction (p99 is about the
# second-worst of them), for a few seconds of float32 CPU time per scoring.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\n# compute the mean of a list\ndef mean(xs):",
    "<|im_start|>user\nName a planet in the solar system.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 24
TOP = 2  # the reference's top 2 give its margin
# Greedy generation that returns each output position's top 2.
PARAMS = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_logprob": True,
          "top_logprobs_num": TOP}


class Scored(NamedTuple):
    """One sequence's scored positions: each token's logprob and the top (logprob, id)
    pairs at its position, most likely first."""

    logprobs: list[float]
    top: list[list[tuple[float, int]]]


class Numerics(NamedTuple):
    positions: int
    mean: float  # mean |Δ logprob| over all positions
    p99: float
    worst: float
    confident: int  # positions whose reference top-2 margin exceeds the gap
    agreement: float  # top-1 agreement over those

    def __str__(self) -> str:
        return (f"{self.positions} positions: mean |Δ logprob| {self.mean:.2e}, p99 {self.p99:.2e}, "
                f"max {self.worst:.2e}; top-1 agreement {self.agreement:.4f} over {self.confident} "
                "positions past the margin gap")


class Bounds(NamedTuple):
    mean: float  # mean |Δ logprob| < mean
    p99: float  # p99 |Δ logprob| < p99
    agreement: float  # top-1 agreement >= agreement where the reference's margin > gap
    gap: float


class NumericsOutOfBounds(AssertionError):
    """A teacher-forced figure broke its bound."""


def check(result: Numerics, bounds: Bounds, what: str) -> None:
    broken = [f"mean |Δ logprob| {result.mean:.2e} >= {bounds.mean}"] if result.mean >= bounds.mean else []
    if result.p99 >= bounds.p99:
        broken.append(f"p99 |Δ logprob| {result.p99:.2e} >= {bounds.p99}")
    if result.confident == 0 or result.agreement < bounds.agreement:
        broken.append(f"top-1 agreement {result.agreement:.4f} < {bounds.agreement} (margin > {bounds.gap})")
    if broken:
        raise NumericsOutOfBounds(f"teacher-forced {what} out of bounds: {'; '.join(broken)} [{result}]")


def measure(ref: Sequence[Scored], got: Sequence[Scored], gap: float) -> Numerics:
    """Compare two scorings of the same tokens, position by position."""
    errors: list[float] = []
    agree = confident = 0
    for a, b in zip(ref, got, strict=True):
        assert len(a.logprobs) == len(b.logprobs), "scored different positions"
        errors += [abs(x - y) for x, y in zip(a.logprobs, b.logprobs)]
        for top_a, top_b in zip(a.top, b.top, strict=True):
            if top_a[0][0] - top_a[1][0] > gap:
                confident += 1
                agree += top_a[0][1] == top_b[0][1]
    ordered = sorted(errors)
    p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
    return Numerics(len(errors), sum(errors) / len(errors), p99, ordered[-1], confident,
                    agree / confident if confident else 0.0)


def score(engine: Any, sequences: Sequence[list[int]], starts: Sequence[int]) -> list[Scored]:
    """Prompt logprobs of `sequences` under `engine`: tokens starts[i].. of each (>= 1)."""
    params = [{"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": s,
               "prompt_top_logprobs_num": TOP} for s in starts]
    outs = engine.generate(list(sequences), params)
    return [Scored([lp for lp, _ in o["meta_info"]["input_token_logprobs"]],
                   [[(lp, t) for lp, t in top] for top in o["meta_info"]["input_top_logprobs"]])
            for o in outs]


def as_scored(out: dict[str, Any]) -> Scored:
    """A greedy output's own logprobs and top pairs (its decode path), as scores."""
    meta = out["meta_info"]
    return Scored([lp for lp, _ in meta["output_token_logprobs"]],
                  [[(lp, t) for t, lp in top] for top in meta["output_top_logprobs"]])


Scorer = Callable[[Sequence[list[int]], Sequence[int]], list[Scored]]  # score() of one engine


class Reference(NamedTuple):
    scorer: Scorer  # scores the tested engine's sequences (reverse)
    prompts: list[Any]  # texts or token ids
    params: dict[str, Any]  # greedy, with top_logprobs_num >= TOP
    prompt_ids: list[list[int]]
    outputs: list[dict[str, Any]]  # its greedy outputs
    scored: list[Scored]  # its sequences (prompt + output) scored from token 1

    def sequences(self, outputs: Sequence[dict[str, Any]]) -> list[list[int]]:
        return [ids + list(o["output_ids"]) for ids, o in zip(self.prompt_ids, outputs, strict=True)]


def reference(engine: Any, prompts: Sequence[Any] = PROMPTS, params: dict[str, Any] | None = None) -> Reference:
    """`engine`'s greedy outputs (asking for prompt logprobs once, for the prompts' ids) and
    its own teacher-forced scores of them."""
    params = PARAMS if params is None else params
    outputs = engine.generate(list(prompts), {**params, "logprob_start_len": 0})
    ids = [[t for _, t in o["meta_info"]["input_token_logprobs"]] for o in outputs]
    seqs = [p + list(o["output_ids"]) for p, o in zip(ids, outputs)]
    scorer = functools.partial(score, engine)
    return Reference(scorer, list(prompts), params, ids, outputs, scorer(seqs, [1] * len(seqs)))


def hf_scorer(model: Any) -> Scorer:
    """transformers' full forward over each sequence as a scorer: tokens starts[i].. (token
    p from the logits at p - 1), with the top pairs."""
    import torch

    def scorer(seqs: Sequence[list[int]], starts: Sequence[int]) -> list[Scored]:
        scored = []
        with torch.inference_mode():
            for seq, start in zip(seqs, starts, strict=True):
                logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, start - 1 : -1].float(), -1)
                chosen = logp.gather(1, torch.tensor(seq[start:])[:, None])[:, 0]
                top = logp.topk(TOP, dim=-1)
                pairs = [list(zip(v.tolist(), i.tolist())) for v, i in zip(top.values, top.indices)]
                scored.append(Scored(chosen.tolist(), pairs))
        return scored

    return scorer


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `ids` by full forwards (no cache)."""
    import torch

    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(torch.argmax(model(torch.tensor([seq])).logits[0, -1])))
    return seq[len(ids) :]


def against_transformers(engine: Any, folder: Any, prompt_ids: list[list[int]], gap: float,
                         new_tokens: int = 8) -> Report:
    """`engine` against transformers' float32 model from the checkpoint `folder`, its greedy
    tokens the fixed reference (both directions, `evaluate`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "return_logprob": True,
              "top_logprobs_num": TOP}
    greedy = [hf_greedy(model, ids, new_tokens) for ids in prompt_ids]
    return evaluate(engine, fixed_reference(hf_scorer(model), prompt_ids, greedy, params), gap)


def fixed_reference(scorer: Scorer, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    params: dict[str, Any]) -> Reference:
    """A reference from given greedy tokens (e.g. transformers' generate), scored by `scorer`."""
    outputs = [{"output_ids": ids} for ids in output_ids]
    seqs = [p + o for p, o in zip(prompt_ids, output_ids, strict=True)]
    return Reference(scorer, prompt_ids, params, prompt_ids, outputs, scorer(seqs, [1] * len(seqs)))


class FreeRunning(NamedTuple):
    first_divergence: list[int]  # per prompt; its length where all agree
    agreement: float

    def __str__(self) -> str:
        return f"free-running: first divergence {self.first_divergence}, agreement {self.agreement:.3f}"


def free_running(ref: Sequence[dict[str, Any]], got: Sequence[dict[str, Any]]) -> FreeRunning:
    pairs = [(a["output_ids"], b["output_ids"]) for a, b in zip(ref, got, strict=True)]
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs]
    return FreeRunning(firsts, sum(firsts) / sum(len(a) for a, _ in pairs))


class Report(NamedTuple):
    forward: Numerics
    reverse: Numerics
    free: FreeRunning
    outputs: list[dict[str, Any]]  # the tested engine's own greedy outputs

    def __str__(self) -> str:
        return f"forward (prefill): {self.forward}\nreverse (decode): {self.reverse}\n{self.free}"


def evaluate(engine: Any, ref: Reference, gap: float) -> Report:
    """Both teacher-forced directions and the free-running figure of `engine` against `ref`."""
    seqs = ref.sequences(ref.outputs)
    forward = measure(ref.scored, score(engine, seqs, [1] * len(seqs)), gap)
    own = engine.generate(ref.prompts, ref.params)  # a plain greedy request: its decode path
    theirs = ref.scorer(ref.sequences(own), [len(ids) for ids in ref.prompt_ids])
    reverse = measure(theirs, [as_scored(o) for o in own], gap)
    return Report(forward, reverse, free_running(ref.outputs, own), own)


def check_report(report: Report, bounds: Bounds) -> None:
    print(report)  # the free-running figure is for reading, not for asserting
    check(report.forward, bounds, "forward (prefill)")
    check(report.reverse, bounds, "reverse (decode)")
