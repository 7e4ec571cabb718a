"""Weight-only quantized linear layers over torch's packed CPU matmul ops.

Batch-1 decode reads every weight once per token, so its speed is memory bandwidth over
weight bytes: int8 halves bfloat16's bytes and 4-bit quarters them. With torch's ops the
activations stay in the compute dtype (only the weights are quantized); tierserve's C++
kernels (below) quantize them too.

- `Int8Linear`: `aten._weight_int8pack_mm`, int8 weights [N, K] with one scale per
  output channel (symmetric, w = q * s).
- `Int4Linear`: `aten._weight_int4pack_mm_for_cpu`, 4-bit weights in groups of 32 along
  K. NOTE: the op's convention (checked numerically in tests/test_quantized.py) is
  w = (q - 8) * scale + zero with q in 0..15, so a GGUF Q4_1 block (w = d * q + m) maps
  to scale = d, zero = m + 8 d, and a Q4_0 block (w = d * (q - 8)) to scale = d, zero = 0.

Both are callables `layer(x, bias=None)` like `F.linear(x, weight, bias)`; gpu/quant/dispatch.py
chooses between them and a dense copy per call. Built with `kernels=True` (model.cpu_kernels)
and the C++ kernels available for the dtype, they run
tierserve's kernels instead (gpu/quant/gemv.py: x quantized to int8 per group of 32, integer
dot products; the weights repacked into the kernels' interleaved tiles, and only the format
the layer runs is kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu.quant import gemv

GROUP = 32  # elements per 4-bit group along K (= a GGUF block)
UNLIMITED = 1 << 62  # `max_rows` of a layer that beats the dense weight at every batch size
_INNER_K_TILES = 2  # packing parameter of the CPU int4 op (K must be a multiple of 16 * this)


class Int8Linear:
    # Rows up to which the op beats a bf16 GEMM (benchmarks/quant_linear.py): above that
    # the step is compute-bound and the dense weight is faster.
    max_rows = 4
    # The same with the C++ kernel (quant_linear.py --model --force-quant): against bfloat16
    # GEMMs on AMX 16 rows (2-core AMX Xeon, all of SmolLM2's linears: 16 rows 16.7 vs 21.9 ms,
    # 32 rows 29.3 vs 23.9 ms); against float32 ones (no native bf16) up to 64 rows (2-core AVX2 EPYC,
    # 2 threads: the 49152 x 576 head 1 row 1.15 vs 14.0 ms, 32 rows 17.1 vs 58.6 ms, 64 rows
    # 29.9 vs 59.3 ms; SmolLM2's 576 x 1536 and 1536 x 576 even at 64 rows, 0.8-0.9x at 256).
    # With AVX512-VNNI and no AMX for torch's bf16 GEMMs, every batch size (gemv.int8_outruns_bf16_gemms).
    kernel_max_rows = 16
    kernel_max_rows_float32 = 64

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, kernels: bool = False) -> None:
        assert qweight.dtype == torch.int8 and qweight.dim() == 2
        self.qweight = qweight.contiguous()
        self.scales = scales.contiguous()
        self.out_features, self.in_features = qweight.shape
        self.kernel_scales: torch.Tensor | None = None  # float32 [N] when the C++ kernel runs
        self.packed = torch.empty(0, dtype=torch.uint8)  # the kernel's layout (gpu/quant/gemv.py)
        if kernels and gemv.available(scales.dtype) and self.in_features % GROUP == 0:
            self.kernel_scales = self.scales.float()
            self.packed = gemv.pack_int8(self.qweight)
            self.qweight = torch.empty(0, dtype=torch.int8)  # only the format the layer runs is kept
            if scales.dtype == torch.float32:
                self.max_rows = self.kernel_max_rows_float32
            else:
                self.max_rows = UNLIMITED if gemv.int8_outruns_bf16_gemms() else self.kernel_max_rows

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype, kernels: bool = False) -> Int8Linear:
        """Symmetric per-output-channel int8 of a float weight [N, K]."""
        w = weight.float()
        # Rounded to the compute dtype first and quantized with the rounded scale, so the
        # op's weight stays within half a step of w (the scale's rounding is not multiplied by q).
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(dtype)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales, kernels)

    @property
    def row_invariant(self) -> bool:
        """Each output row depends on its own input row only, at any row count (the C++ kernel)."""
        return self.kernel_scales is not None

    def dequantize(self) -> torch.Tensor:
        q = self.qweight if self.kernel_scales is None else gemv.unpack_int8(self.packed, self.out_features)
        return q.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel_scales is not None:
            scales = self.kernel_scales
            out = on_rows(x, self.out_features, lambda rows: gemv.int8_matmul(rows, self.packed, scales))
        elif x.dtype == torch.float32:
            out = on_rows(x, self.out_features, lambda rows: int8_matmul_float32(rows, self.qweight, self.scales))
        else:
            out = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        return out + bias if bias is not None else out

    def nbytes(self) -> int:
        return self.qweight.nbytes + self.packed.nbytes + self.scales.nbytes


def int8_matmul_float32(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ (q * s)^T, as (x @ q^T) * s with q converted to float32 a block of
    output channels at a time.

    NOTE: torch's `_weight_int8pack_mm` is vectorized for bfloat16 / float16 activations
    only; with float32 ones it runs a scalar loop (on an AVX2 EPYC, a 576 x 1536 weight took
    1.5 ms for 1 row and 40 ms for 32, against 0.6 and 1.2 ms here;
    `benchmarks/quant_linear.py --int8-float32`). A block of rows (~512 KiB as float32)
    stays in the cache while its GEMM reads it; the whole weight converted at once would be
    a 4x copy per call. The blocks depend on the weight's shape only, so a row's result
    does not depend on the other rows of the call (invariant 7, with fixed tiles)."""
    n, k = qweight.shape
    block = max(256, (1 << 17) // k)
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for start in range(0, n, block):
        torch.mm(x, qweight[start : start + block].float().t(), out=out[:, start : start + block])
    return out.mul_(scales.float())


class Int4Linear:
    max_rows = 8  # see Int8Linear.max_rows
    # The C++ kernel (int8 activations, integer dot products) is faster than float32 GEMMs and
    # than bfloat16 GEMMs without AMX at prefill shapes too (benchmarks/quant_linear.py --model
    # --force-quant), so it takes every batch there. Where torch's bf16 GEMMs run on AMX tiles
    # they win above ~24 rows (2-core AMX Xeon, all of SmolLM2's linears, the head int8: 16 rows
    # 15.7 vs 21.9 ms, 32 rows 28.2 vs 23.9, 512 rows 426 vs 103), so a bf16 layer keeps its
    # dense copy for those batches there.
    kernel_max_rows = UNLIMITED
    kernel_max_rows_amx = 24

    def __init__(
        self, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
        kernels: bool = False,
    ) -> None:
        """nibbles: int32 [N, K] in 0..15; scales, zeros: [N, K / GROUP] (op convention above)."""
        n, k = nibbles.shape
        if k % (16 * _INNER_K_TILES) or k % GROUP:
            raise ValueError(f"int4 linear needs K divisible by {16 * _INNER_K_TILES}, got {k}")
        self.out_features, self.in_features, self.dtype = n, k, dtype
        self.kernel = kernels and gemv.available(dtype)
        if self.kernel:  # the kernel's w = d * q + m: m = zero - 8 * scale
            self.packed = gemv.pack_q4(nibbles, scales, zeros.float() - 8.0 * scales.float())
            self.scales_and_zeros = torch.empty(0, dtype=dtype)
            amx = dtype == torch.bfloat16 and gemv.bf16_gemms_on_amx()
            self.max_rows = self.kernel_max_rows_amx if amx else self.kernel_max_rows
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32), _INNER_K_TILES)
        # [K / GROUP, N, 2]: the op's scales_and_zeros layout
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype, kernels: bool = False) -> Int4Linear:
        """Asymmetric 4-bit groups (min/max) of a float weight [N, K] (no Q4 blocks to reuse)."""
        n, k = weight.shape
        g = weight.float().reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        return cls(q.reshape(n, k), scale, lo + 8 * scale, dtype, kernels)

    @property
    def row_invariant(self) -> bool:
        """Each output row depends on its own input row only, at any row count (the C++ kernel)."""
        return self.kernel

    def dequantize(self) -> torch.Tensor:
        """The float weight the op computes with (for tests)."""
        return self(torch.eye(self.in_features, dtype=self.dtype)).t().float()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel:
            out = on_rows(x, self.out_features, lambda rows: gemv.q4_matmul(rows, self.packed, self.out_features))
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)
        return out + bias if bias is not None else out

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def on_rows(x: torch.Tensor, n: int, matmul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A C++ kernel's matmul on x [..., K] seen as rows [M, K] of a dtype it takes."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype not in gemv.DTYPES:
        return matmul(rows.float()).to(x.dtype).reshape(*x.shape[:-1], n)
    return matmul(rows).reshape(*x.shape[:-1], n)


QuantLinear = Int8Linear | Int4Linear
