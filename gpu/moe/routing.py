"""Router scores -> each token's top-k experts and their weights."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Routing(NamedTuple):
    experts: torch.Tensor  # int64 [T, k]: each token's experts, best first
    weights: torch.Tensor  # [T, k] in the compute dtype: how much each expert's output counts


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> Routing:
    """Qwen3-MoE / Mixtral routing: softmax over every expert in float32, the k largest,
    renormalized to sum to 1 where `normalize` (norm_topk_prob), then cast to the
    logits' dtype (Qwen3MoeTopKRouter)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return Routing(experts, top.to(logits.dtype))
