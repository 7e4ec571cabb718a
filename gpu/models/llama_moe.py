"""Llama-family decoders whose MLP is a sparse MoE block in the layers `arch.sparse_layers`
names — a router (softmax over the experts, top-k, renormalized where the architecture
does), then the experts' SwiGLU MLPs through a MoE implementation (gpu/moe/). No shared
expert. Qwen3-MoE (QK-norm attention, Qwen3MoeSparseMoeBlock) and Mixtral
(MixtralSparseMoeBlock: w1 gate, w3 up, w2 down, always renormalized) differ only in
their tensor names.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.model_config import ModelArchConfig
from gpu.models.hybrid_common import Weights
from gpu.models.llama import LlamaModel, _Layer
from gpu.moe.routing import softmax_topk
from gpu.moe.torch_moe import Experts
from kernel.registry import lookup, register


@register("model", "qwen3_moe")
class Qwen3MoeModel(LlamaModel):
    accepts_moe = True  # accepts `moe` (model.moe: the registered MoE implementation)
    # Checkpoint names: layer i's block, and each expert's gate, up and down projections.
    BLOCK = "mlp"
    GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"

    def __init__(self, arch: ModelArchConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, moe: str = "torch", **options: Any) -> None:
        super().__init__(arch, weights, dtype, device, **options)
        self.moe: Any = lookup("moe", moe)()
        self.static_shapes = self.moe.static_shapes  # the graph runner needs static shapes
        w = Weights(weights, dtype, device, options.get("quantization"))
        self.routers: dict[int, torch.Tensor] = {}
        self.experts: dict[int, Experts] = {}
        # Tokens routed to each expert of each sparse layer since start (metrics: routing skew);
        # counted on the device, read by `expert_tokens`.
        self._routed = {i: torch.zeros(arch.num_experts, dtype=torch.int64, device=device) for i in arch.sparse_layers}
        for i in arch.sparse_layers:
            p = f"model.layers.{i}.{self.BLOCK}."
            self.routers[i] = w.get(p + "gate.weight")  # dense: routing stays exact where experts are quantized
            self.experts[i] = Experts(
                gate_up=[w.linear([p + f"experts.{e}.{self.GATE}.weight", p + f"experts.{e}.{self.UP}.weight"])
                         for e in range(arch.num_experts)],
                down=[w.linear([p + f"experts.{e}.{self.DOWN}.weight"]) for e in range(arch.num_experts)],
            )

    def _mlp(self, i: int, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        if i not in self.routers:
            return super()._mlp(i, layer, x)
        arch = self.arch
        routing = softmax_topk(self.linear(x, self.routers[i]), arch.num_experts_per_tok, arch.norm_topk_prob)
        self._routed[i] += torch.bincount(routing.experts.reshape(-1), minlength=arch.num_experts)
        return self.moe(self.linear, x, routing, self.experts[i])  # type: ignore[no-any-return]

    def expert_tokens(self) -> dict[str, list[int]]:
        """Per sparse layer (its index, as text: a JSON key), the tokens routed to each expert so far."""
        return {str(i): counts.tolist() for i, counts in self._routed.items()}


@register("model", "mixtral")
class MixtralModel(Qwen3MoeModel):
    BLOCK = "block_sparse_moe"
    GATE, UP, DOWN = "w1", "w3", "w2"
