"""The Llama decoder's element-wise glue as fused C++ CPU ops (gpu/kernels/cpu/llama_glue.cpp).

Batch-1 decode on CPU spends milliseconds a step dispatching small torch ops (an RMSNorm is
8 of them, a RoPE 11 for q and again for k); these wrappers run each piece as one op. They
round where gpu/models/llama.py's torch code rounds, so results match it to float32's last
bits (a reduction summed in another order), or 1 ulp in bfloat16.
"""

from __future__ import annotations

import torch

from gpu.kernels import cpu

KERNELS = "llama_glue"
DTYPES = (torch.float32, torch.bfloat16)


def available(cpu_kernels: bool, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the model may run the fused ops: kernels allowed, a CPU model in a dtype
    they implement, and the extension built (a failed build falls back to torch ops)."""
    return cpu_kernels and device.type == "cpu" and dtype in DTYPES and cpu.load(KERNELS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x_f * rsqrt(mean(x_f^2) + eps)).to(dtype)` of each row of x [T, N]."""
    return torch.ops.tierserve_cpu.llama_glue_rms_norm(x, weight, eps)  # type: ignore[no-any-return]


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): a residual add fused with the next norm."""
    total, normed = torch.ops.tierserve_cpu.llama_glue_add_rms_norm(h, delta, weight, eps)
    return total, normed


def rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, Hkv, D] rotated (rotate-half layout) and v [T, Hkv, D], all
    contiguous, from the fused projection qkv [T, (H + 2 Hkv) * D] and cos/sin [T, D/2]."""
    q, k, v = torch.ops.tierserve_cpu.llama_glue_rope(qkv, cos, sin, heads, kv_heads)
    return q, k, v


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I] (gate first, as `chunk(2)` splits it)."""
    return torch.ops.tierserve_cpu.llama_glue_silu_mul(gate_up)  # type: ignore[no-any-return]
