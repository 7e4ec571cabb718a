"""Speculative acceptance by rejection sampling (`speculative.acceptance: rejection`).

A verify row that tests a drafted token x, which the drafter drew from a distribution q (a
draft model's, over the vocabulary; a point mass at x for a drafter that guesses, such as
n-gram lookup), keeps x with probability min(1, p(x) / q(x)) and otherwise draws from the
residual max(0, p - q), normalized; p is the target's distribution as the row's own draw
reads it (bias, grammar mask, penalties, temperature, then top-k / top-p / min-p). Whatever
q is, the token that comes out is distributed as p (the speculative sampling theorem of
Leviathan et al. and Chen et al., 2023): output follows the target's distribution, though
not the token sequence a run without speculation draws (`exact` acceptance keeps that).
The gain over `exact`: a draft model that samples from q close to p has most of its drafts
kept, where `exact` keeps a draft only if it equals the target's own draw.

Every random number is a pure function of (seed, step) per row (gpu/draw_keys.py): the
uniform that decides (`accept_uniform`) and the draft's own draw (`draft_uniform`) are salted
apart from the row's Gumbel noise, which draws the residual. NOTE: the three must be
independent; a draft drawn with the row's own noise would bias the residual draw.
Greedy rows never test (p is a point mass: `exact` and this rule keep the same tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Tests(NamedTuple):
    """The random rows of a sampling batch that test a drafted token."""

    rows: torch.Tensor  # [T] positions among the batch's random rows
    tokens: torch.Tensor  # [T] the drafted tokens
    uniforms: torch.Tensor  # [T] float64, accept_uniform of each row's (seed, step)
    q: torch.Tensor  # [T, V] the distributions the drafts were drawn from (a point mass for a guess)

    @staticmethod
    def build(rows: list[int], tokens: list[int], uniforms: list[float], q: list[torch.Tensor | None],
              vocab_size: int, device: torch.device) -> Tests:
        dists = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
        for i, (token, dist) in enumerate(zip(tokens, q)):
            if dist is None:
                dists[i, token] = 1.0
            else:
                dists[i] = dist.to(device=device, dtype=torch.float32)
        return Tests(torch.tensor(rows, dtype=torch.int64, device=device),
                     torch.tensor(tokens, dtype=torch.int64, device=device),
                     torch.tensor(uniforms, dtype=torch.float64, device=device), dists)


def kept(p_x: torch.Tensor, q_x: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Whether each draft is kept: u < p(x) / q(x), as u * q(x) < p(x) (q(x) = 0 keeps x
    wherever p(x) > 0)."""
    return uniforms * q_x.double() < p_x.double()


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) per row, unnormalized (a draw by Gumbel-max needs no normalizing); p
    itself where that is empty (only rounding can make it so: a rejection implies p(x) < q(x),
    so p - q has positive mass somewhere)."""
    rest = (p - q).clamp_(min=0.0)
    empty = rest.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p, rest)


def settle(tempered: torch.Tensor, noise: torch.Tensor, tests: Tests) -> torch.Tensor:
    """The tested rows' tokens: tempered, their logits as their draw reads them [T, V]
    (-inf where truncated); noise, their Gumbel noise [T, V]."""
    p = torch.softmax(tempered, dim=-1)
    x = tests.tokens.unsqueeze(1)
    keep = kept(p.gather(1, x).squeeze(1), tests.q.gather(1, x).squeeze(1), tests.uniforms)
    drawn = (residual(p, tests.q).log() + noise).argmax(dim=-1)
    return torch.where(keep, tests.tokens, drawn)
