"""float32 and bfloat16 linears of a few rows through tierserve's C++ kernel
(gpu/kernels/cpu/dense_gemv.cpp).

A decode step, and a MoE step's expert groups of a few tokens each, multiply a few rows by
weights far larger than the caches: the time is one read of the weight, which the kernel
streams once for all the rows, where torch's GEMMs read it at a fraction of the bandwidth
(`benchmarks/moe.py`). Outside deterministic mode only (another summation order), with
`model.cpu_kernels` on, for dense float32 or bfloat16 weights on CPU (bf16: products summed
in float32 — pairs of them by AVX512-BF16's dot product where the CPU has it — and the
output rounded once, as torch's bf16 GEMMs do); anything else runs `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu import numerics
from gpu.kernels import cpu
from gpu.quant import gemv

KERNELS = "dense_gemv"
# Rows of x up to which the kernel beats torch's GEMM: beyond, the GEMM reads the weight as
# fast and computes faster. bfloat16 with AVX512-BF16 (the kernel's pairs path, x kept in
# bf16): 32 rows; [N x K] on a 2-core Zen 5 EPYC, kernel / F.linear per weight (weights
# streamed from memory): [1024 x 1024] 1 row 52 / 107 us, 16 rows 90 / 138, 32 rows 144 /
# 168, 64 rows 333 / 239; [1536 x 1024] 32 rows 193 / 271; the [49152 x 1024] head 32 rows
# 6.7 / 7.1 ms. bfloat16 elsewhere (widened in the kernel; oneDNN's bf16 GEMM on
# AVX512-BF16 computes faster): 4 rows, measured on a Zen 4 EPYC before the pairs path,
# [1024 x 1024] kernel / F.linear 1 row 83 / 191 us, 4 rows 187 / 219, 8 rows 386 / 248.
# float32: 8 rows, one pass of the AVX2 kernel; 16 where the kernel has its AVX-512 path (a
# pass of 16 rows): SmolLM2-sized weights (40 x [3072 x 576] + 40 x [576 x 1536]) on a
# 2-core Zen 5 EPYC, kernel / F.linear 9 rows 27 / 44 ms, 16 rows 36 / 40 ms, so a
# speculative verify step of a float32 model stays on the kernel.
# Where torch's bf16 GEMMs run on AMX tiles (they beat even the 4-bit kernel above ~24
# rows there: gpu/quant/linears.py Int4Linear), the pairs path is not measured against
# them, so bf16 keeps its 4 rows.
_FLAGS = numerics.cpu_flags()
MAX_ROWS = {torch.float32: 16 if "avx512f" in _FLAGS else 8,
            torch.bfloat16: 32 if {"avx512f", "avx512_bf16"} <= _FLAGS and not gemv.bf16_gemms_on_amx() else 4}
DTYPES = tuple(MAX_ROWS)


def available(cpu_kernels: bool, dtype: torch.dtype, device: torch.device) -> bool:
    return cpu_kernels and device.type == "cpu" and dtype in DTYPES and cpu.load(KERNELS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the kernel where x has at most MAX_ROWS[its dtype] rows."""
    if x.dim() != 2 or x.dtype not in DTYPES or x.shape[0] > MAX_ROWS[x.dtype] or weight.dtype != x.dtype:
        return F.linear(x, weight, bias)
    out = _kernel(x, weight)
    return out + bias if bias is not None else out


def _kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.tierserve_cpu.dense_gemv(x, weight)  # type: ignore[no-any-return]
