"""Pieces shared by the hybrid models (Qwen3.5, LFM2): norms, partial RoPE, SwiGLU, weights
(the Llama family uses the last two as well).

Each follows its Hugging Face reference op for op (where the cast to the model dtype
happens matters in bf16). Norms use `x * (1 / sqrt(.))` rather than `rsqrt`: on CPU the
vectorized rsqrt and the scalar one that handles a tensor's tail differ in the last bit,
so a token's norm would depend on how many tokens share the step (invariant 7); sqrt and
division are correctly rounded on both paths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu.batch_invariant import mean_of_squares, pointwise
from gpu.quant.dispatch import LinearWeight, QuantSpec, build_linear

Linear = Callable[..., torch.Tensor]


class Weights:
    """Checkpoint tensors by name, moved to the compute device and dtype on first use."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantSpec | None = None,
    ) -> None:
        self._weights = weights
        self.dtype = dtype
        self.device = device
        self.quant = quant

    def __contains__(self, name: str) -> bool:
        return name in self._weights

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self._weights:
            raise KeyError(f"checkpoint lacks tensor {name}")
        return self._weights[name].to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self._weights else None

    def cat(self, names: list[str]) -> torch.Tensor:
        return torch.cat([self.get(n) for n in names])

    def linear(self, names: list[str]) -> LinearWeight:
        """The weight of a linear fused from `names`: dense, or quantized per `quant`."""
        return build_linear(self.quant, names, self.cat(names))


def _inv_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return 1.0 / torch.sqrt(mean_of_squares(xf) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style: weight * normalized(x) cast to x's dtype (LFM2)."""
    xf = x.float()
    return weight * (xf * _inv_rms(xf, eps)).to(x.dtype)


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5 / Qwen3-Next: normalized(x) * (1 + weight) in float32, then cast; the
    checkpoint stores weight - 1 (zero-initialised)."""
    xf = x.float()
    return (xf * _inv_rms(xf, eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's gated norm over the last axis: weight * normalized(x), times silu(gate)."""
    xf = x.float()
    normed = weight * (xf * _inv_rms(xf, eps)).to(x.dtype)
    return (normed * pointwise(F.silu, gate.float())).to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim / 2] computed as the reference does (float32 inverse
    frequencies times float32 positions, then cast to the model dtype)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first 2 * cos.shape[-1] dims of x [T, heads, D]; the rest
    passes through (partial rotary)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def swiglu(linear: Linear, x: torch.Tensor, gate_up: LinearWeight, down: LinearWeight) -> torch.Tensor:
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(pointwise(F.silu, gate) * up, down)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid from exp, in float32: on CPU torch.sigmoid's vectorized and scalar paths
    differ in the last bit in float32, so an element's value would depend on where the
    tensor's tail starts, i.e. on the batch (a shared expert's gate is one value a token)."""
    return (1.0 / (1.0 + torch.exp(-x.float()))).to(x.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """F.softplus (threshold 20) from exp and log1p: F.softplus's vectorized and scalar
    paths differ in the last bit on CPU, these do not (invariant 7)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
