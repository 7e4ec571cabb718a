"""A model's sparse MoE layers: their weights, the block's forward and the routing counts.

One block per sparse layer: a router (dense, so routing stays exact where experts are
quantized; softmax, or LFM2-MoE's sigmoid with an expert bias: gpu/moe/routing.py), the routed experts run by a registered implementation (registry kind `moe`),
and for Qwen3-Next / Qwen3.5-MoE a shared expert every token goes through, scaled by
sigmoid(x @ shared_expert_gate^T) (Qwen3NextSparseMoeBlock; the sigmoid batch-invariant,
gpu/models/hybrid_common.py). The models (llama_moe.py,
qwen3_next.py) own a `MoeLayers` and call it for the layers in `arch.sparse_layers`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from gpu.model_config import ModelArchConfig
from gpu.models.hybrid_common import Linear, Weights, sigmoid, swiglu
from gpu.moe.names import HF_NAMES, ExpertNames
from gpu.moe.routing import Routing, sigmoid_topk, softmax_topk
from gpu.moe.torch_moe import Experts
from gpu.quant.dispatch import LinearWeight
from kernel.registry import lookup


class SharedExpert(NamedTuple):
    gate_up: LinearWeight
    down: LinearWeight
    gate: torch.Tensor  # [1, hidden]: sigmoid(x @ gate^T) scales the shared MLP's output


class SparseBlock(NamedTuple):
    router: torch.Tensor  # [experts, hidden]
    expert_bias: torch.Tensor | None  # float32 [experts]: sigmoid routing's choice bias (LFM2-MoE)
    experts: Experts
    shared: SharedExpert | None


class MoeLayers:
    """The sparse layers of one model. `shared`: each block also has a gated shared expert."""

    def __init__(self, arch: ModelArchConfig, w: Weights, implementation: str, names: ExpertNames = HF_NAMES,
                 shared: bool = False) -> None:
        self.arch = arch
        self.impl: Any = lookup("moe", implementation)()
        self.static_shapes: bool = self.impl.static_shapes  # the graph runner needs static shapes
        self.blocks = {i: self._load(w, f"model.layers.{i}.{names.block}.", names, shared) for i in arch.sparse_layers}
        # Tokens routed to each expert of each sparse layer since start (metrics: routing
        # skew); counted on the device (no host read in the step), read by `expert_tokens`.
        self._routed = {i: torch.zeros(arch.num_experts, dtype=torch.int64, device=w.device) for i in self.blocks}
        self._deferred: dict[int, torch.Tensor] | None = None  # see `deferred`

    def _load(self, w: Weights, p: str, names: ExpertNames, shared: bool) -> SparseBlock:
        n = self.arch.num_experts
        experts = Experts(
            gate_up=[w.linear([p + f"experts.{e}.{names.gate}.weight", p + f"experts.{e}.{names.up}.weight"])
                     for e in range(n)],
            down=[w.linear([p + f"experts.{e}.{names.down}.weight"]) for e in range(n)],
        )
        common = None
        if shared:
            s = p + "shared_expert."
            common = SharedExpert(
                gate_up=w.linear([s + "gate_proj.weight", s + "up_proj.weight"]),
                down=w.linear([s + "down_proj.weight"]),
                gate=w.get(p + "shared_expert_gate.weight"),
            )
        used = self.arch.expert_bias and p + "expert_bias" in w
        bias = w.get(p + "expert_bias", torch.float32) if used else None
        return SparseBlock(router=w.get(p + "gate.weight"), expert_bias=bias, experts=experts, shared=common)

    def __contains__(self, layer: int) -> bool:
        return layer in self.blocks

    def forward(self, layer: int, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """The sparse block's output for the normed hidden states x [T, hidden]. NOTE: under
        tensor parallelism every expert holds this rank's slice of its intermediate width
        (gpu/parallel/shard.py) and the router is whole, so this is the rank's partial sum
        (the shared expert's gate scales it linearly): the model all-reduces it once."""
        block = self.blocks[layer]
        routing = self.route(linear(x, block.router), block)
        if self._deferred is None:
            self.count({layer: routing.experts}, len(x))
        else:
            self._deferred[layer] = routing.experts
        out = self.impl(linear, x, routing, block.experts)
        if block.shared is None:
            return out  # type: ignore[no-any-return]
        shared = block.shared
        return out + sigmoid(linear(x, shared.gate)) * swiglu(linear, x, shared.gate_up, shared.down)  # type: ignore[no-any-return]

    def route(self, logits: torch.Tensor, block: SparseBlock) -> Routing:
        arch = self.arch
        if arch.moe_routing == "sigmoid":
            return sigmoid_topk(logits, arch.num_experts_per_tok, arch.norm_topk_prob, block.expert_bias,
                                arch.routed_scaling_factor)
        return softmax_topk(logits, arch.num_experts_per_tok, arch.norm_topk_prob)

    @contextmanager
    def deferred(self) -> Iterator[dict[int, torch.Tensor]]:
        """Within it, `forward` counts nothing and records each layer's chosen experts [T, k]
        in the dict it yields; the caller counts the live rows with `count` (NOTE: a
        static-shape forward's padding rows are routed like tokens and must not be counted;
        a captured graph's records are its static outputs, rewritten by every replay)."""
        self._deferred = {}
        try:
            yield self._deferred
        finally:
            self._deferred = None

    def count(self, routes: dict[int, torch.Tensor], tokens: int) -> None:
        """Add the first `tokens` rows of each layer's chosen experts to its counts."""
        for layer, experts in routes.items():
            flat = experts[:tokens].reshape(-1)
            self._routed[layer].index_add_(0, flat, torch.ones_like(flat))

    def expert_tokens(self) -> dict[str, list[int]]:
        """Per sparse layer (its index, as text: a JSON key), the tokens routed to each expert so far."""
        return {str(i): counts.tolist() for i, counts in self._routed.items()}
