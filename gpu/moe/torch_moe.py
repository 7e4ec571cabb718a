"""`moe: torch` — tokens grouped by expert, one expert MLP per group.

Each expert runs its SwiGLU MLP over the tokens routed to it; its outputs, times their
routing weights, are added into the result in expert order (the Hugging Face reference's
order). NOTE: batch invariance (deterministic mode, invariant 7): with a row-invariant
`linear` a token's expert output does not depend on which tokens share its group, and its
sum runs over its own experts in a fixed order, so grouping changes no bit.

Eager only: the group sizes are read on the host (graphs need a static-shape one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from gpu.models.hybrid_common import Linear, swiglu
from gpu.moe.routing import Routing
from gpu.quant.dispatch import LinearWeight
from kernel.registry import register


class Experts(NamedTuple):
    gate_up: Sequence[LinearWeight]  # per expert: gate and up fused
    down: Sequence[LinearWeight]


FEW_TOKENS = 8  # up to here (decode steps) the groups are formed on the host, in Python


@register("moe", "torch")
class TorchMoE:
    static_shapes = False  # reads group sizes on the host

    def __call__(self, linear: Linear, x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        if x.shape[0] <= FEW_TOKENS:
            return self._few(linear, x, routing, experts)
        return self._grouped(linear, x, routing, experts)

    @staticmethod
    def _few(linear: Linear, x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        """A few tokens: one host read of the routing, groups formed in Python, the same
        expert order and the same products and sums as `_grouped` (equal bits where
        `linear` is row-invariant), at a fraction of its ops (a decode step's MoE layer is
        dominated by them)."""
        groups: dict[int, list[tuple[int, float]]] = {}
        for t, (chosen, weights) in enumerate(zip(routing.experts.tolist(), routing.weights.tolist())):
            for e, w in zip(chosen, weights):
                groups.setdefault(e, []).append((t, w))
        out = torch.zeros_like(x)
        for e in sorted(groups):
            tokens, weights = zip(*groups[e])
            if len(x) == 1:  # batch 1: the token itself, no gather or scatter
                out += swiglu(linear, x, experts.gate_up[e], experts.down[e]) * weights[0]
                continue
            rows = torch.tensor(tokens)
            y = swiglu(linear, x.index_select(0, rows), experts.gate_up[e], experts.down[e])
            out.index_put_((rows,), y * torch.tensor(weights, dtype=x.dtype)[:, None], accumulate=True)
        return out

    @staticmethod
    def _grouped(linear: Linear, x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        k = routing.experts.shape[1]
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=len(experts.down)).tolist()
        weights = routing.weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            tokens = pairs // k
            y = swiglu(linear, x.index_select(0, tokens), experts.gate_up[e], experts.down[e])
            # NOTE: a group's tokens are distinct, so this adds one term to each of their rows
            # (index_add_ does the same, and took ~10x as long at decode sizes here).
            out.index_put_((tokens,), y * weights.index_select(0, pairs)[:, None], accumulate=True)
        return out
