"""float32 linears of a few rows through tierserve's C++ kernel (gpu/kernels/cpu/dense_gemv.cpp).

A decode step, and a MoE step's expert groups of a few tokens each, multiply 1-8 rows by
weights far larger than the caches: the time is one read of the weight, which the kernel
streams once for all the rows, where torch's GEMMs read it at a fraction of the bandwidth
(`benchmarks/moe.py`). Outside deterministic mode only (another summation order), with
`model.cpu_kernels` on, for dense float32 weights on CPU; anything else runs `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.kernels import cpu

KERNELS = "dense_gemv"
MAX_ROWS = 8  # beyond, torch's GEMM reads the weight as fast and computes faster


def available(cpu_kernels: bool, dtype: torch.dtype, device: torch.device) -> bool:
    return cpu_kernels and device.type == "cpu" and dtype == torch.float32 and cpu.load(KERNELS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the kernel where x has at most MAX_ROWS float32 rows."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    out = _kernel(x, weight)
    return out + bias if bias is not None else out


def _kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.tierserve_cpu.dense_gemv(x, weight)  # type: ignore[no-any-return]
