"""Router scores -> each token's top-k experts and their weights."""

from __future__ import annotations

from typing import NamedTuple

import torch

from gpu.batch_invariant import sum_last
from gpu.models.hybrid_common import sigmoid


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
        top = top / sum_last(top)
    return Routing(experts, top.to(logits.dtype))


def sigmoid_topk(logits: torch.Tensor, k: int, normalize: bool, bias: torch.Tensor | None,
                 scale: float) -> Routing:
    """LFM2-MoE routing (Lfm2MoeTopKRouter): sigmoid scores in the logits' dtype; the k
    largest of scores + bias (float32, where the checkpoint has an expert bias) choose the
    experts, weighted by their unbiased scores; renormalized (sum + 1e-6) where
    `normalize`; times `scale` (routed_scaling_factor). The sigmoid is the batch-invariant
    one (gpu/models/hybrid_common.py)."""
    scores = sigmoid(logits)
    if bias is None:
        top, experts = torch.topk(scores, k, dim=-1)
    else:
        experts = torch.topk(scores + bias, k, dim=-1).indices
        top = torch.gather(scores, 1, experts)
    if normalize:
        top = top / (sum_last(top) + 1e-6)
    return Routing(experts, top * scale)
