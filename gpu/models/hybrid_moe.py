"""Hybrid decoders whose MLPs are sparse MoE blocks (gpu/moe/layers.py) in the layers
`arch.sparse_layers` names, a dense SwiGLU elsewhere:

- Qwen3.5-MoE (text, `Qwen3_5MoeForCausalLM`) and Qwen3-Next (`Qwen3NextForCausalLM`):
  Qwen3.5's decoder (gpu/models/qwen3_5.py); each block has a gated shared expert.
  Qwen3.5-MoE: every layer sparse, top-k weights always renormalized. Qwen3-Next: sparse
  where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers, renormalized
  per norm_topk_prob; its linear layers store their input projection as two tensors
  grouped by key head (`in_proj_qkvz`, `in_proj_ba`: transformers'
  `fix_query_key_value_ordering`), reordered into Qwen3.5's layout once at load, so the
  forward is Qwen3.5's, op for op.
- LFM2-MoE (`Lfm2MoeForCausalLM`): LFM2's decoder (gpu/models/lfm2.py); the first
  num_dense_layers dense, the rest sparse with sigmoid routing and an expert bias, no
  shared expert.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from gpu.model_config import ModelArchConfig
from gpu.models.hybrid_base import HybridBlock
from gpu.models.hybrid_common import Weights
from gpu.models.lfm2 import Lfm2Model
from gpu.models.qwen3_5 import Qwen3_5Model
from gpu.moe.layers import MoeLayers
from gpu.moe.names import HF_NAMES, ExpertNames
from gpu.parallel.group import TensorParallel
from kernel.registry import register


class SparseMlps:
    """The MoE part of a hybrid MoE model (a mixin before its hybrid decoder class)."""

    accepts_moe = True  # accepts `moe` (model.moe: the registered MoE implementation)
    NAMES: ClassVar[ExpertNames] = HF_NAMES
    SHARED_EXPERT: ClassVar[bool] = True
    arch: ModelArchConfig
    linear: Any

    def __init__(self, arch: ModelArchConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, deterministic: bool = False, moe: str = "torch",
                 tp: TensorParallel | None = None) -> None:
        super().__init__(arch, weights, dtype, device, deterministic, tp)  # type: ignore[call-arg]
        self.moe = MoeLayers(arch, Weights(weights, dtype, device), moe, self.NAMES, shared=self.SHARED_EXPERT)
        self.static_shapes = self.moe.static_shapes

    def _mlp(self, i: int, block: HybridBlock[Any, Any], x: torch.Tensor) -> torch.Tensor:
        if i not in self.moe:
            return super()._mlp(i, block, x)  # type: ignore[misc,no-any-return]
        return self._reduce(self.moe.forward(i, self.linear, x), None)  # type: ignore[attr-defined,no-any-return]

    def expert_tokens(self) -> dict[str, list[int]]:
        """Per sparse layer (its index, as text: a JSON key), the tokens routed to each expert so far."""
        return self.moe.expert_tokens()


@register("model", "qwen3_5_moe_text")
class Qwen3_5MoeModel(SparseMlps, Qwen3_5Model):
    name = "qwen3_5_moe_text"


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


@register("model", "lfm2_moe")
class Lfm2MoeModel(SparseMlps, Lfm2Model):
    name = "lfm2_moe"
    NAMES = ExpertNames(block="feed_forward", gate="w1", up="w3", down="w2")
    SHARED_EXPERT = False
