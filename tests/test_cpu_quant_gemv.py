"""tierserve's C++ few-row quantized matmuls (gpu/kernels/cpu/quant_gemv.cpp) against
independent references, in every instruction set compiled here (AVX-512, AVX2, scalar).

- 4-bit: GGUF Q4_0 / Q4_1 blocks made by the `gguf` package's quantizer, dequantized by its
  reference code, against Int4Linear built on those blocks with the kernel
  (gpu/quant/gemv.py packs them). float32 x: the kernel computes with the checkpoint's
  levels exactly, so only float32 rounding is left (measured max error / max |ref| 8e-7;
  bound 1e-5). bfloat16 x: the output is rounded to bfloat16 (measured 3.7e-3; bound 1e-2).
- int8: the kernel against the layer's dequantized weight (measured 1.6e-6 and 3.6e-3; same
  bounds).
- Shapes: SmolLM2's (K, N), an N not a multiple of the 16-row tile, an output head of 8200
  rows; M 1..8 (one pass) and 11 (two passes).
- Planted bugs (monkeypatched into the packer): nibbles of a pair swapped, offsets dropped:
  each turns the 4-bit check red.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gpu.quant import gemv
from gpu.quant.gguf_blocks import Q4Blocks, cat_blocks
from gpu.quant.linears import Int4Linear, Int8Linear

if not gemv.available(torch.float32):
    pytest.skip("the quant_gemv C++ kernels do not build here", allow_module_level=True)

ISAS = list(torch.ops.tierserve_cpu.quant_gemv_isas())
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SHAPES = ((576, 576), (576, 960), (576, 1536), (1536, 576), (576, 3072), (576, 200), (576, 8200))  # (K, N)
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 11)
HEAD_ROWS = (1, 4, 11)  # for the 8200-row head, to stay quick


def rows_for(n: int) -> tuple[int, ...]:
    return ROWS if n <= 3072 else HEAD_ROWS


def q4_case(kind: str, k: int, n: int, seed: int = 0) -> tuple[Int4Linear, torch.Tensor, np.ndarray]:
    """A kernel-backed Int4Linear on gguf-quantized blocks and the gguf dequantized weight."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.02 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[kind])
    ref = torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(n, k))
    layer = Int4Linear(*cat_blocks([Q4Blocks(kind, torch.from_numpy(raw))]), torch.float32, kernels=True)
    return layer, ref, raw


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max())


def q4_errors(layer: Int4Linear, ref: torch.Tensor, dtype: torch.dtype) -> list[float]:
    errors = []
    for m in rows_for(layer.out_features):
        x = torch.randn(m, layer.in_features, generator=torch.Generator().manual_seed(m)).to(dtype)
        expected = x.float() @ ref.t()
        for isa in ISAS:
            got = torch.ops.tierserve_cpu.quant_gemv_q4(x, layer.packed, layer.out_features, isa)
            assert got.dtype == dtype and got.shape == (m, layer.out_features)
            errors.append(relative_error(got, expected))
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_q4_kernel_matches_gguf_dequantized(kind: str, k: int, n: int, dtype: torch.dtype) -> None:
    layer, ref, _ = q4_case(kind, k, n)
    assert layer.kernel and layer.scales_and_zeros.numel() == 0  # only the kernel's format is kept
    assert max(q4_errors(layer, ref, dtype)) < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_int8_kernel_matches_dequantized(k: int, n: int, dtype: torch.dtype) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.02
    layer = Int8Linear.quantize(w, dtype, kernels=True)
    assert layer.kernel_scales is not None
    ref = layer.dequantize()
    for m in rows_for(n):
        x = torch.randn(m, k).to(dtype)
        for isa in ISAS:
            got = torch.ops.tierserve_cpu.quant_gemv_int8(x, layer.qweight, layer.kernel_scales, isa)
            assert got.dtype == dtype
            assert relative_error(got, x.float() @ ref.t()) < BOUND[dtype]


def test_layers_run_the_kernel_and_match_the_torch_ops() -> None:
    """The layer call (any leading shape, a bias) equals the kernel and stays close to torch's op."""
    layer, ref, raw = q4_case("Q4_1", 576, 960)
    torch_op = Int4Linear(*cat_blocks([Q4Blocks("Q4_1", torch.from_numpy(raw))]), torch.float32)
    x, bias = torch.randn(2, 3, 576), torch.randn(960)
    got = layer(x, bias)
    assert torch.equal(got.reshape(6, 960), gemv.q4_matmul(x.reshape(6, 576), layer.packed, 960) + bias)
    assert relative_error(got.reshape(6, 960), torch_op(x.reshape(6, 576), bias)) < BOUND[torch.float32]
    assert relative_error(layer.dequantize(), ref) < 1e-6
    w = torch.randn(960, 576) * 0.02
    rows = x.reshape(6, 576)
    assert relative_error(Int8Linear.quantize(w, torch.float32, kernels=True)(rows), Int8Linear.quantize(w, torch.float32)(rows)) < 1e-5


def test_without_kernels_the_torch_ops_run() -> None:
    layer, _, _ = q4_case("Q4_0", 576, 96)
    plain = Int4Linear.quantize(layer.dequantize(), torch.bfloat16)
    assert not plain.kernel and plain.scales_and_zeros.numel() > 0
    assert Int8Linear.quantize(torch.randn(96, 576), torch.bfloat16).kernel_scales is None


def swapped_pairs(nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    n, k = nibbles.shape
    swapped = nibbles.reshape(n, k // 2, 2).flip(-1).reshape(n, k)
    return ORIGINAL_PACK(swapped, scales, offsets)


def dropped_offsets(nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return ORIGINAL_PACK(nibbles, scales, torch.zeros_like(offsets))


ORIGINAL_PACK = gemv.pack_q4


@pytest.mark.parametrize("planted", [swapped_pairs, dropped_offsets])
def test_red_planted_packing_bugs(monkeypatch: pytest.MonkeyPatch, planted: object) -> None:
    monkeypatch.setattr(gemv, "pack_q4", planted)
    layer, ref, _ = q4_case("Q4_1", 576, 200)
    assert min(q4_errors(layer, ref, torch.float32)) > 100 * BOUND[torch.float32]
