"""tierserve's C++ quantized matmuls (gpu/kernels/cpu/quant_gemv.cpp) from Python.

The kernels stream each weight byte once per call for many rows of x, so decode steps run
near memory bandwidth; they take float32 or bfloat16 activations.

Both quantize x to int8 per group of 32 (s = max|x| / 127) and compute integer dot
products, for any number of rows (prefill too), over weights interleaved in tiles of 16
output rows:
- int8: float32 per-row scales (w = q * s) beside the weight; `pack_int8`: per tile and pair
  of columns (k, k + 1) 32 bytes, rows 0-7's (q[k], q[k + 1]), then rows 8-15's.
- 4-bit: `pack_q4`: per tile and
  group of 32 along K, 16 fp16 scales d, 16 fp16 offsets m (w = d * q + m), then per quad of
  columns (4u .. 4u + 3) 32 bytes, byte 2r holding row r's weights 4u (low nibble) and
  4u + 2 (high), byte 2r + 1 its 4u + 1 and 4u + 3.
  NOTE: the C++ kernels read exactly this layout (see quant_gemv_core.h).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu import numerics
from gpu.kernels import cpu

KERNELS = "quant_gemv"
DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes the kernels take
TILE = 16  # output rows per interleaved tile
GROUP = 32  # 4-bit weights per (d, m) group along K


def available(dtype: torch.dtype) -> bool:
    """The kernels are built (or buildable) here and take activations of `dtype`."""
    return dtype in DTYPES and cpu.load(KERNELS)


def pack_q4(nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 32 * 320] from nibbles int [N, K] in 0..15 and d, m
    [N, K / 32] (w = d * q + m); rows past N are zeros (never written out)."""
    n, k = nibbles.shape
    pad = (-n) % TILE
    tiles, groups = (n + pad) // TILE, k // GROUP
    q = F.pad(nibbles.to(torch.uint8), (0, 0, 0, pad)).reshape(tiles, TILE, groups, GROUP // 4, 2, 2)
    quads = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [tile, group, quad, row, 2]

    def halves(v: torch.Tensor) -> torch.Tensor:  # [N, groups] -> uint8 [tile, group, 32]
        v = F.pad(v.to(torch.float16), (0, 0, 0, pad)).reshape(tiles, TILE, groups)
        return v.permute(0, 2, 1).contiguous().view(torch.uint8)

    parts = [halves(scales), halves(offsets), quads.reshape(tiles, groups, -1)]
    return torch.cat(parts, dim=-1).reshape(tiles, -1).contiguous()


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(N / 16), K * 16] from int8 q [N, K]; rows past N are zeros."""
    n, k = q.shape
    pad = (-n) % TILE
    tiles = F.pad(q, (0, 0, 0, pad)).reshape(-1, 2, 8, k // 2, 2)  # [tile, half, row, pair, 2]
    return tiles.permute(0, 3, 1, 2, 4).contiguous().view(torch.uint8).reshape(-1, k * TILE)


def unpack_int8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The int8 q [N, K] that `pack_int8` packed (for tests and dequantize)."""
    k = packed.shape[1] // TILE
    tiles = packed.view(torch.int8).reshape(-1, k // 2, 2, 8, 2).permute(0, 2, 3, 1, 4)
    return tiles.reshape(-1, k)[:n]


def int8_outruns_bf16_gemms() -> bool:
    """Whether the int8 kernel beats a bfloat16 GEMM at every batch size here: where it sums
    with vpdpbusd (its `vnni` path) and torch's bf16 GEMMs have no AMX to run on. Measured
    on a Zen 4 EPYC (AVX512-VNNI + BF16, no AMX), all of SmolLM2's linears at 16 / 64 / 256
    rows: 15.2 / 42.2 / 141 ms against bf16 GEMMs' 28.3 / 59.5 / 175 ms
    (`benchmarks/quant_linear.py --model --force-quant`). Elsewhere the int8 layer keeps
    its crossover (Int8Linear.kernel_max_rows)."""
    if "vnni" not in compiled_isas():
        return False
    return not bf16_gemms_on_amx()


def bf16_gemms_on_amx() -> bool:
    """Whether torch's bfloat16 GEMMs (oneDNN) run on AMX tiles here: the CPU has them and
    the kernel lets this process use them."""
    return {"amx_bf16", "amx_tile"} <= numerics.cpu_flags() and numerics.amx_permitted()


def compiled_isas() -> list[str]:
    """The kernels' code paths built here, best first (none where they do not build)."""
    return list(torch.ops.tierserve_cpu.quant_gemv_isas()) if cpu.load(KERNELS) else []


def auto_isa() -> str:
    """The code path the kernels run here: the widest compiled one, except that the 512-bit
    path (`vnni512`) runs only where it measured faster than the 256-bit one."""
    return str(torch.ops.tierserve_cpu.quant_gemv_isa()) if cpu.load(KERNELS) else ""


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.tierserve_cpu.quant_gemv_q4(x, packed, out_features)


def int8_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.tierserve_cpu.quant_gemv_int8(x, packed, scales)
