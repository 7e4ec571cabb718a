"""`moe: cpu` — the routed experts of a step of up to a few hundred tokens in one C++ call
(gpu/kernels/cpu/moe_experts.cpp); larger steps, and anything the op does not take, run
`moe: torch`.

A decode step routes each of its tokens to top_k experts, so with tens of tokens every
expert gets a handful: the step's time is one read of the touched experts' weights. The
op groups the (token, slot) pairs by expert in C++ (no host read of the routing in
Python), reads each touched expert's weight rows once for all of its tokens, and sums each
token's weighted outputs in float32 in ascending expert order, in two parallel regions a
layer where `moe: torch` runs ~10 ops per expert.

Expert weights dense in the model's dtype (float32, bfloat16), or quantized
(`model.quantization`, a GGUF's 4-bit expert blocks) in the C++ kernels' int8 or 4-bit
tiles: the same two regions over the packed weights, x quantized to int8 once for all
pairs (gpu/kernels/cpu/quant_gemv_core.h). Anything else runs `moe: torch`.

Outside deterministic mode only (kernel/numerics_choice.py `resolve_moe` refuses it
there): not torch's summation order or SiLU bits, and on AVX2 a row's sums depend on how
many rows share its expert's pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gpu.kernels import cpu
from gpu.models.hybrid_common import Linear
from gpu.moe.routing import Routing
from gpu.moe.torch_moe import Experts, TorchMoE
from gpu.quant import gemv
from gpu.quant.dispatch import QuantizedWeight
from gpu.quant.linears import Int4Linear, Int8Linear
from kernel.registry import register

KERNELS = "moe_experts"
# Tokens a step up to which the op runs: beyond, each expert's group is large enough for
# torch's GEMMs to compute as fast (benchmarks/moe_layer.py: the benchmark model's layer on
# a 2-core Zen 5 EPYC, op / torch, bf16: 32 tokens 3.5 / 6.8 ms, 256 11.0 / 15.4, 512
# 20.0 / 23.6; float32: 256 34.3 / 45.9, 512 78.2 / 74.3).
# Where torch's bf16 GEMMs run on AMX tiles (not measured against the op) bf16 keeps to
# decode-sized steps, where the time is the read of the weights either way.
MAX_TOKENS = {torch.float32: 256, torch.bfloat16: 32 if gemv.bf16_gemms_on_amx() else 512}
# int8 experts: torch's path runs the same int8 kernel per expert, and catches up sooner
# (moe_layer.py --formats int8, bf16: 256 tokens 11.9 / 6.7 ms, 512 21.0 / 23.8).
MAX_TOKENS_INT8 = {dtype: min(limit, 256) for dtype, limit in MAX_TOKENS.items()}
DTYPES = tuple(MAX_TOKENS)


class QuantizedExperts(NamedTuple):
    """The experts' packed weights in the C++ kernels' layout (gpu/quant/gemv.py), one format."""

    q4: bool
    gate_up: list[torch.Tensor]
    gate_up_scales: list[torch.Tensor]  # int8: float32 [2I] per expert; q4: empty
    down: list[torch.Tensor]
    down_scales: list[torch.Tensor]
    width: int  # I


@register("moe", "cpu")
class CpuMoE:
    static_shapes = False  # the op's groups are the step's routing (as `moe: torch`'s)

    def __init__(self) -> None:
        self._torch = TorchMoE()
        # By id(experts), with the Experts itself (an entry holds its key alive): how the
        # op takes them in a dtype — "dense", their packed form, or None (torch's path).
        self._plans: dict[tuple[int, torch.dtype], tuple[Experts, str | QuantizedExperts | None]] = {}

    def __call__(self, linear: Linear, x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        plan = self.plan(x, experts)
        if plan == "dense":
            return run_op(x, routing, experts)
        if isinstance(plan, QuantizedExperts):
            return run_quantized_op(x, routing, plan)
        return self._torch(linear, x, routing, experts)

    def plan(self, x: torch.Tensor, experts: Experts) -> str | QuantizedExperts | None:
        """How the op runs this step, or None where `moe: torch` does: a few tokens on CPU."""
        if x.device.type != "cpu" or x.dtype not in DTYPES or not cpu.load(KERNELS):
            return None
        key = (id(experts), x.dtype)
        entry = self._plans.get(key)
        if entry is None or entry[0] is not experts:
            entry = (experts, plan_for(experts, x.dtype))
            self._plans[key] = entry
        plan = entry[1]
        int8 = isinstance(plan, QuantizedExperts) and not plan.q4
        return plan if x.shape[0] <= (MAX_TOKENS_INT8 if int8 else MAX_TOKENS)[x.dtype] else None


def plan_for(experts: Experts, dtype: torch.dtype) -> str | QuantizedExperts | None:
    """"dense" where every weight is a tensor of `dtype`; the packed weights where all are
    quantized in one format the C++ kernels hold (their tiles: widths multiples of 32);
    else None."""
    weights = (*experts.gate_up, *experts.down)
    if all(isinstance(w, torch.Tensor) and w.dtype == dtype for w in weights):
        return "dense"
    if not all(isinstance(w, QuantizedWeight) for w in weights):
        return None
    layers = [w.quant for w in weights]  # type: ignore[union-attr]
    width = layers[-1].in_features
    if layers[0].in_features % 32 or width % 32:
        return None
    if all(isinstance(q, Int4Linear) and q.kernel for q in layers):
        gate_up = [q.packed for q in layers[: len(experts.gate_up)]]  # type: ignore[union-attr]
        down = [q.packed for q in layers[len(experts.gate_up) :]]  # type: ignore[union-attr]
        return QuantizedExperts(True, gate_up, [], down, [], width)
    if all(isinstance(q, Int8Linear) and q.kernel_scales is not None for q in layers):
        half = len(experts.gate_up)
        return QuantizedExperts(False, [q.packed for q in layers[:half]], [q.kernel_scales for q in layers[:half]],  # type: ignore[misc,union-attr]
                                [q.packed for q in layers[half:]], [q.kernel_scales for q in layers[half:]],  # type: ignore[misc,union-attr]
                                width)
    return None


def run_op(x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
    """The C++ op over dense expert weights in x's dtype."""
    return torch.ops.tierserve_cpu.moe_experts(  # type: ignore[no-any-return]
        x, routing.experts, routing.weights.to(x.dtype), experts.gate_up, experts.down)


def run_quantized_op(x: torch.Tensor, routing: Routing, experts: QuantizedExperts) -> torch.Tensor:
    """The C++ op over packed int8 or 4-bit expert weights."""
    return torch.ops.tierserve_cpu.moe_experts_quantized(  # type: ignore[no-any-return]
        x, routing.experts, routing.weights.to(x.dtype), experts.gate_up, experts.gate_up_scales, experts.down,
        experts.down_scales, experts.q4, experts.width)


def row_invariant() -> bool:
    """Whether this machine's build gives a token the same bits whichever tokens share its
    step (the AVX-512 kernels) — the op is still kept out of deterministic mode."""
    return bool(cpu.load(KERNELS) and torch.ops.tierserve_cpu.moe_experts_row_invariant())
