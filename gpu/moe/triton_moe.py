"""`moe: triton` — the routed experts as one fused grouped GEMM (gpu/kernels/triton_moe.py).

The (token, slot) pairs are sorted by expert on the device and each expert's group padded
to whole blocks; one kernel runs every block's gate_up matmul and silu(gate) * up, one its
down matmul, and each token's k outputs are added in slot order times their routing
weights. The experts' float weights are stacked into [E, 2I, H] and [E, H, I] on first
use (a copy, cached per `Experts`): expert memory is then held twice.

Static shapes (`static_shapes = True`): no host read of the routing, and every buffer and
grid is sized from (tokens, top_k, num_experts) alone, so the graph runner can capture it.

NOTE: invariant 7 (batch invariance). The kernels' tiles, warps and K loop are constants
and a pair's row never reads another, so a token's output is the same bits whichever
tokens share its experts' blocks and wherever it sits in the batch. The same bits as
`moe: torch` are not promised: different matmuls and sum order (within float rounding).

`linear` is not called: the experts' matmuls are the kernels' own, so quantized expert
weights are refused (model.quantization: none). This module imports cleanly without
triton (the registry imports every module of gpu.moe); a missing triton is an error when
the implementation is built. On CUDA the kernels are compiled; without CUDA they run only
under the Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import NamedTuple

import torch

from gpu.models.hybrid_common import Linear
from gpu.moe.routing import Routing
from gpu.moe.torch_moe import Experts
from kernel.registry import MissingExtraError, optional_module, register


class StackedExperts(NamedTuple):
    gate_up: torch.Tensor  # [E, 2I, H]: per expert its gate rows, then its up rows
    down: torch.Tensor  # [E, H, I]


def load_kernels(device: torch.device) -> ModuleType:
    """The kernel module, or a RuntimeError saying why the kernels cannot run on `device`."""
    interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    if device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"model.moe: triton runs on CUDA devices (the model is on {device}); pick `model.moe: torch` "
            "or `dense`, or set TRITON_INTERPRET=1 to run the kernels in the (slow) Triton interpreter"
        )
    from gpu.kernels import triton_moe

    if device.type != "cuda" and not triton_moe.INTERPRETED:
        raise RuntimeError(
            "the MoE Triton kernels were compiled for the GPU (gpu.kernels.triton_moe was imported "
            f"before TRITON_INTERPRET=1 was set) and cannot run on {device}; set TRITON_INTERPRET=1 "
            "before triton is first imported"
        )
    return triton_moe


def stack_experts(experts: Experts) -> StackedExperts:
    """The experts' weights as two contiguous stacked tensors; quantized ones are refused."""
    if not all(isinstance(w, torch.Tensor) for w in (*experts.gate_up, *experts.down)):
        raise ValueError(
            "model.moe: triton runs float expert weights, and this model's experts are quantized: "
            "set model.quantization: none, or pick model.moe: torch"
        )
    gate_up = torch.stack(list(experts.gate_up)).contiguous()  # type: ignore[arg-type]
    down = torch.stack(list(experts.down)).contiguous()  # type: ignore[arg-type]
    return StackedExperts(gate_up, down)


@register("moe", "triton")
class TritonMoE:
    static_shapes = True

    def __init__(self) -> None:
        try:
            optional_module("triton", "model.moe: triton")
        except MissingExtraError as exc:
            raise RuntimeError(f"{exc}; pick `model.moe: torch` to run without it") from exc
        self._kernels: ModuleType | None = None
        # By id(experts), with the Experts itself: an entry holds its key alive, so an id
        # is never reused for another model's (or layer's) experts while it is cached.
        self._stacked: dict[int, tuple[Experts, StackedExperts]] = {}

    def __call__(self, linear: Linear, x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        if self._kernels is None:
            self._kernels = load_kernels(x.device)
        weights = self.stacked(experts)
        out: torch.Tensor = self._kernels.fused_moe(x, routing.experts, routing.weights, weights.gate_up,
                                                    weights.down)
        return out

    def stacked(self, experts: Experts) -> StackedExperts:
        """The stacked weights of `experts`, built on its first call."""
        entry = self._stacked.get(id(experts))
        if entry is None or entry[0] is not experts:
            entry = (experts, stack_experts(experts))
            self._stacked[id(experts)] = entry
        return entry[1]
