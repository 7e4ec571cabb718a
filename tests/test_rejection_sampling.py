"""Rejection-sampling acceptance (gpu/rejection.py) keeps the target's distribution: over many
seeds, the tokens that verify rows give (a draft kept, or a residual draw) are distributed as
the target's p, whatever distribution q the drafts came from — a draft model's, or a point
mass (a guess) — truncation included. The planted bugs (the keep test ignoring q, the
residual not taking q out) skew the distribution and go red."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gpu import rejection
from gpu.draw_keys import draft_uniform
from gpu.forward_batch import SamplingRow
from gpu.sampling import SamplingBatch, draw_drafts, sample

CPU = torch.device("cpu")
N = 40_000  # rows (seeds) per check: a token's frequency lands within 5 sigma of p


def row(draft: int, q: torch.Tensor | None, temperature: float = 1.0, top_k: int = -1) -> SamplingRow:
    return SamplingRow(temperature=temperature, top_p=1.0, top_k=top_k, min_p=0.0, frequency_penalty=0.0,
                       presence_penalty=0.0, repetition_penalty=1.0, top_logprobs_num=0, seed=0, step=0,
                       logprobs=False, draft_token=draft, draft_q=q)


def verify(logits: torch.Tensor, q: torch.Tensor | None, guess: int = 0, **settings: Any) -> tuple[torch.Tensor, float]:
    """N verify rows of one target distribution, each testing a draft drawn from q (or the
    fixed `guess`): the frequency of each output token, and the share of drafts kept."""
    gen = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(q, N, replacement=True, generator=gen).tolist() if q is not None else [guess] * N
    params = [row(x, q, **settings) for x in drafts]
    seeds = list(range(1000, 1000 + N))
    batch = SamplingBatch.build(params, seeds, [7] * N, [()] * N, [()] * N, logits.numel(), CPU,
                                want_logprobs=[False] * N)
    tokens = torch.tensor(sample(logits.expand(N, -1), batch).token_ids)
    kept = (tokens == torch.tensor(drafts)).float().mean().item()
    return torch.bincount(tokens, minlength=logits.numel()).double() / N, kept


def assert_follows(freq: torch.Tensor, p: torch.Tensor) -> None:
    sigma = (p * (1 - p) / N).sqrt().clamp(min=1 / N)
    worst = ((freq - p).abs() / sigma).max().item()
    assert worst < 5, f"rejection sampling guard: frequencies {freq.tolist()} are not p = {p.tolist()} ({worst:.1f} sigma)"


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
Q = torch.tensor([0.05, 0.4, 0.3, 0.1, 0.1, 0.05])  # far from p: many rejections


def target(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1) -> torch.Tensor:
    scaled = logits / temperature
    if top_k > 0:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], -math.inf)
    return torch.softmax(scaled.double(), dim=-1)


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.7}, {"top_k": 3}])
def test_draft_model_drafts_keep_the_target_distribution(settings: dict[str, Any]) -> None:
    p = target(LOGITS, **settings)
    freq, kept = verify(LOGITS, Q, **settings)
    assert_follows(freq, p)
    # The kept share is sum(min(p, q)) = 1 - TV(p, q): more than the chance q's draw equals p's.
    overlap = torch.minimum(p, Q.double()).sum().item()
    assert abs(kept - overlap) < 0.02, (kept, overlap)


def test_a_draft_equal_to_the_target_is_always_kept() -> None:
    p = torch.softmax(LOGITS, dim=-1)
    freq, kept = verify(LOGITS, p)
    assert kept == 1.0
    assert_follows(freq, p.double())


@pytest.mark.parametrize("guess", [0, 4])
def test_guessed_drafts_keep_the_target_distribution(guess: int) -> None:
    """A drafter that guesses (n-gram lookup): q a point mass, kept with probability p(guess)."""
    p = target(LOGITS)
    freq, kept = verify(LOGITS, None, guess)
    assert_follows(freq, p)
    assert abs(kept - p[guess].item()) < 0.02


@pytest.mark.parametrize("plant", ["keep_ignores_q", "residual_is_p"])
def test_planted_bugs_red(monkeypatch: pytest.MonkeyPatch, plant: str) -> None:
    if plant == "keep_ignores_q":
        monkeypatch.setattr(rejection, "kept", lambda p_x, q_x, u: u < p_x.double())
    else:
        monkeypatch.setattr(rejection, "residual", lambda p, q: p)
    freq, _ = verify(LOGITS, Q)
    with pytest.raises(AssertionError, match="rejection sampling guard"):
        assert_follows(freq, target(LOGITS))


def test_draft_draws_follow_their_distribution() -> None:
    """A draft model's draws (inverse CDF at a salted uniform) follow the q they report,
    truncated tokens never drawn; verified against the target, the output follows p."""
    draft_logits = torch.tensor([0.0, 1.5, 1.0, 0.2, 0.1, -2.0])
    settings = [row(-1, None, temperature=0.9, top_k=4)] * N
    tokens, dists = draw_drafts(draft_logits.expand(N, -1), settings, [draft_uniform(s, 7) for s in range(N)])
    q = dists[0].double()
    assert q[0] == 0 and q[5] == 0 and abs(q.sum().item() - 1) < 1e-6  # top-k 4 keeps tokens 1-4
    assert_follows(torch.bincount(torch.tensor(tokens), minlength=6).double() / N, q)
    params = [row(x, dists[i]) for i, x in enumerate(tokens)]
    batch = SamplingBatch.build(params, list(range(1000, 1000 + N)), [7] * N, [()] * N, [()] * N, 6, CPU,
                                want_logprobs=[False] * N)
    out = torch.tensor(sample(LOGITS.expand(N, -1), batch).token_ids)
    assert_follows(torch.bincount(out, minlength=6).double() / N, target(LOGITS))
