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
from gpu.moe.layers import MoeLayers
from gpu.moe.names import HF_NAMES, MIXTRAL_NAMES
from kernel.registry import register


@register("model", "qwen3_moe")
class Qwen3MoeModel(LlamaModel):
    accepts_moe = True  # accepts `moe` (model.moe: the registered MoE implementation)
    NAMES = HF_NAMES

    def __init__(self, arch: ModelArchConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, moe: str = "torch", **options: Any) -> None:
        super().__init__(arch, weights, dtype, device, **options)
        w = Weights(weights, dtype, device, options.get("quantization"))
        self.moe = MoeLayers(arch, w, moe, self.NAMES)
        self.static_shapes = self.moe.static_shapes

    def _mlp(self, i: int, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        if i not in self.moe:
            return super()._mlp(i, layer, x)
        return self._reduce(self.moe.forward(i, self.linear, x), None)  # each rank's experts are partial

    def expert_tokens(self) -> dict[str, list[int]]:
        """Per sparse layer (its index, as text: a JSON key), the tokens routed to each expert so far."""
        return self.moe.expert_tokens()


@register("model", "mixtral")
class MixtralModel(Qwen3MoeModel):
    NAMES = MIXTRAL_NAMES
