"""Qwen3.5-MoE (text, `Qwen3_5MoeForCausalLM`) and Qwen3-Next (`Qwen3NextForCausalLM`):
Qwen3.5's hybrid decoder (gpu/models/qwen3_5.py) with sparse MoE blocks that have a gated
shared expert (gpu/moe/layers.py).

Qwen3.5-MoE: every layer's MLP is the sparse block, top-k weights always renormalized.
Qwen3-Next: the sparse block where (i + 1) % decoder_sparse_step == 0 and i is not in
mlp_only_layers (a dense SwiGLU elsewhere), renormalized per norm_topk_prob; and its
linear layers store their input projection as two tensors grouped by key head
(`in_proj_qkvz`, `in_proj_ba`, transformers' `fix_query_key_value_ordering`), which the
loader reorders into Qwen3.5's layout once, so the forward is Qwen3.5's, op for op.
"""

from __future__ import annotations

import torch

from gpu.model_config import ModelArchConfig
from gpu.models.hybrid_base import HybridBlock
from gpu.models.hybrid_common import Weights
from gpu.models.qwen3_5 import Qwen3_5Model, _Attention, _DeltaNet
from gpu.moe.layers import MoeLayers
from kernel.registry import register


@register("model", "qwen3_5_moe_text")
class Qwen3_5MoeModel(Qwen3_5Model):
    name = "qwen3_5_moe_text"
    accepts_moe = True  # accepts `moe` (model.moe: the registered MoE implementation)

    def __init__(self, arch: ModelArchConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, deterministic: bool = False, moe: str = "torch") -> None:
        super().__init__(arch, weights, dtype, device, deterministic)
        self.moe = MoeLayers(arch, Weights(weights, dtype, device), moe, shared=True)
        self.static_shapes = self.moe.static_shapes

    def _mlp(self, i: int, block: HybridBlock[_Attention, _DeltaNet], x: torch.Tensor) -> torch.Tensor:
        if i not in self.moe:
            return super()._mlp(i, block, x)
        return self.moe.forward(i, self.linear, x)

    def expert_tokens(self) -> dict[str, list[int]]:
        """Per sparse layer (its index, as text: a JSON key), the tokens routed to each expert so far."""
        return self.moe.expert_tokens()


@register("model", "qwen3_next")
class Qwen3NextModel(Qwen3_5MoeModel):
    name = "qwen3_next"

    def _in_proj(self, w: Weights, q: str) -> torch.Tensor:
        """in_proj_qkvz rows are, per key head g, [q_g | k_g | v of its value heads | z of
        them]; in_proj_ba rows, per key head, [b of its value heads | a of them]. Reordered
        to [all q | all k | all v | all z | all b | all a] (value heads in order g * rep + r,
        as the reference's reshapes number them)."""
        arch = self.arch
        groups, dk, dv = arch.linear_num_key_heads, arch.linear_key_head_dim, arch.linear_value_head_dim
        rep = arch.linear_num_value_heads // groups
        qkvz = w.get(q + "in_proj_qkvz.weight")
        ba = w.get(q + "in_proj_ba.weight")
        hidden = qkvz.shape[-1]
        parts = qkvz.view(groups, 2 * dk + 2 * rep * dv, hidden).split([dk, dk, rep * dv, rep * dv], dim=1)
        b, a = ba.view(groups, 2 * rep, hidden).split([rep, rep], dim=1)
        return torch.cat([t.reshape(-1, hidden) for t in (*parts, b, a)]).contiguous()
