"""Weight-only quantized linear layers over torch's packed CPU matmul ops.

Batch-1 decode reads every weight once per token, so its speed is memory bandwidth over
weight bytes: int8 halves bfloat16's bytes and 4-bit quarters them. Activations stay in
the compute dtype; only the weights are quantized.

- `Int8Linear`: `aten._weight_int8pack_mm`, int8 weights [N, K] with one scale per
  output channel (symmetric, w = q * s).
- `Int4Linear`: `aten._weight_int4pack_mm_for_cpu`, 4-bit weights in groups of 32 along
  K. NOTE: the op's convention (checked numerically in tests/test_quantized.py) is
  w = (q - 8) * scale + zero with q in 0..15, so a GGUF Q4_1 block (w = d * q + m) maps
  to scale = d, zero = m + 8 d, and a Q4_0 block (w = d * (q - 8)) to scale = d, zero = 0.

Both are callables `layer(x, bias=None)` like `F.linear(x, weight, bias)`; gpu/quant/dispatch.py
chooses between them and a dense copy per call.
"""

from __future__ import annotations

import torch

GROUP = 32  # elements per 4-bit group along K (= a GGUF block)
_INNER_K_TILES = 2  # packing parameter of the CPU int4 op (K must be a multiple of 16 * this)


class Int8Linear:
    # Rows up to which the op beats a bf16 GEMM (benchmarks/quant_linear.py): above that
    # the step is compute-bound and the dense weight is faster.
    max_rows = 4

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        assert qweight.dtype == torch.int8 and qweight.dim() == 2
        self.qweight = qweight.contiguous()
        self.scales = scales.contiguous()
        self.out_features, self.in_features = qweight.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int8Linear:
        """Symmetric per-output-channel int8 of a float weight [N, K]."""
        w = weight.float()
        # Rounded to the compute dtype first and quantized with the rounded scale, so the
        # op's weight stays within half a step of w (the scale's rounding is not multiplied by q).
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(dtype)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        return out + bias if bias is not None else out

    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


class Int4Linear:
    max_rows = 8  # see Int8Linear.max_rows

    def __init__(self, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> None:
        """nibbles: int32 [N, K] in 0..15; scales, zeros: [N, K / GROUP] (op convention above)."""
        n, k = nibbles.shape
        if k % (16 * _INNER_K_TILES) or k % GROUP:
            raise ValueError(f"int4 linear needs K divisible by {16 * _INNER_K_TILES}, got {k}")
        self.out_features, self.in_features = n, k
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32), _INNER_K_TILES)
        # [K / GROUP, N, 2]: the op's scales_and_zeros layout
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int4Linear:
        """Asymmetric 4-bit groups (min/max) of a float weight [N, K] (no Q4 blocks to reuse)."""
        n, k = weight.shape
        g = weight.float().reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        return cls(q.reshape(n, k), scale, lo + 8 * scale, dtype)

    def dequantize(self) -> torch.Tensor:
        """The float weight the op computes with (for tests)."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return self(eye).t().float()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)
        return out + bias if bias is not None else out

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


QuantLinear = Int8Linear | Int4Linear
