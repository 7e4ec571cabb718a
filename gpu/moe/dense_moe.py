"""`moe: dense` — every expert over every token: static shapes, for the graph runner.

Each expert's SwiGLU MLP runs over the whole batch; a token's output adds, in expert order,
each expert's output times the token's routing weight for it (zero for an expert it was
not routed to). No host read of the routing (so a graph can capture it), at num_experts /
top_k times the expert FLOPs of `moe: torch` — an implementation for captured steps and
small models, not for a 512-expert checkpoint's prefill.

NOTE: the same bits as `moe: torch` wherever `linear` is row-invariant (deterministic
mode, invariant 7): a token's sum has the same terms in the same order, and an unrouted
expert adds +0 or -0 to a partial sum that is never -0 (it starts at +0), which leaves it
unchanged.
"""

from __future__ import annotations

import torch

from gpu.models.hybrid_common import Linear, swiglu
from gpu.moe.routing import Routing
from gpu.moe.torch_moe import Experts
from kernel.registry import register


@register("moe", "dense")
class DenseMoE:
    static_shapes = True

    def __call__(self, linear: Linear, x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        out = torch.zeros_like(x)
        zero = torch.zeros_like(routing.weights)
        for e in range(len(experts.down)):
            # A token's top-k experts are distinct: at most one term of the sum is not zero.
            weight = torch.where(routing.experts == e, routing.weights, zero).sum(dim=-1)
            out = out + swiglu(linear, x, experts.gate_up[e], experts.down[e]) * weight[:, None]
        return out
