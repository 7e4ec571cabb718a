"""The quantized linears' numerics against independent references, on random data.

- 4-bit: random GGUF Q4_0 / Q4_1 blocks, dequantized by the `gguf` package's own
  reference code, against torch's int4 CPU op fed with the same blocks through
  gpu/quant/gguf_blocks.py. In float32 the op computes with the checkpoint's levels
  exactly, so the bound is float32 rounding of a 576-term dot product (measured max
  relative error ~8e-7; bound 1e-4). In bfloat16 (scales and activations rounded to bf16)
  the measured max relative error is ~5e-3; bound 3e-2.
- int8: the op against the dequantized int8 weight (same bounds), and the quantization
  error against the float weight within half a step per channel.
- Planted bug: nibbles swapped in the unpacking -> the 4-bit check goes red.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from gpu.quant import gguf_blocks
from gpu.quant.dispatch import QuantizedWeight, make_linear, quant_tiled
from gpu.quant.gguf_blocks import Q4Blocks, cat_blocks
from gpu.quant.linears import Int4Linear, Int8Linear

N, K = 96, 576
BOUND = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def random_q4_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, k / 32 * block bytes] of valid GGUF blocks with random scales and nibbles."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = (rng.random((n, nb, 1)) * 0.02 + 1e-3).astype(np.float16)
    parts = [d.view(np.uint8)]
    if kind == "Q4_1":
        parts.append((rng.standard_normal((n, nb, 1)) * 0.05).astype(np.float16).view(np.uint8))
    parts.append(rng.integers(0, 256, (n, nb, 16), dtype=np.uint8))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def reference_weight(kind: str, raw: np.ndarray, k: int) -> torch.Tensor:
    values = dequantize(raw, GGMLQuantizationType[kind])
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(raw.shape[0], k))


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max())


def int4_error(kind: str, dtype: torch.dtype, seed: int = 0) -> float:
    raw = random_q4_blocks(kind, N, K, seed)
    layer = Int4Linear(*cat_blocks([Q4Blocks(kind, torch.from_numpy(raw))]), dtype)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(seed))
    ref = x @ reference_weight(kind, raw, K).t()
    return relative_error(layer(x.to(dtype)), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4_op_matches_gguf_dequantized_blocks(kind: str, dtype: torch.dtype) -> None:
    for seed in range(3):
        assert int4_error(kind, dtype, seed) < BOUND[dtype]


def test_q4_blocks_stack_along_rows() -> None:
    """A fused weight (qkv) is its parts' blocks stacked: the same as the parts' outputs."""
    a, b = (torch.from_numpy(random_q4_blocks("Q4_1", n, K, s)) for n, s in ((64, 1), (32, 2)))
    fused = Int4Linear(*cat_blocks([Q4Blocks("Q4_1", a), Q4Blocks("Q4_1", b)]), torch.float32)
    parts = [Int4Linear(*cat_blocks([Q4Blocks("Q4_1", t)]), torch.float32) for t in (a, b)]
    x = torch.randn(3, K)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))


def test_red_swapped_nibbles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: high and low nibbles swapped -> the 4-bit numerics check fails."""
    monkeypatch.setattr(gguf_blocks, "split_nibbles", lambda qs: torch.cat([qs >> 4, qs & 0x0F], -1).to(torch.int32))
    assert int4_error("Q4_1", torch.float32) > 100 * BOUND[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_op_matches_its_dequantized_weight(dtype: torch.dtype) -> None:
    w = torch.randn(N, K) * 0.02
    layer = Int8Linear.quantize(w, dtype)
    step = layer.scales.float()[:, None]
    assert float(((layer.dequantize() - w).abs() / step).max()) <= 0.5 + 1e-2  # rounding, at most half a step
    x = torch.randn(4, K)
    assert relative_error(layer(x.to(dtype)), x @ layer.dequantize().t()) < BOUND[dtype]


def test_int8_float32_op_blocks_cover_every_output_channel() -> None:
    """float32 activations run the blocked int8 matmul (gpu/quant/linears.py): 700 channels
    of K = 576 are three blocks, the last one partial."""
    w = torch.randn(700, K) * 0.02
    layer = Int8Linear.quantize(w, torch.float32)
    x = torch.randn(5, K)
    assert relative_error(layer(x), x @ layer.dequantize().t()) < BOUND[torch.float32]


def test_int4_quantize_of_float_weight_is_close() -> None:
    w = torch.randn(N, K) * 0.02
    layer = Int4Linear.quantize(w, torch.float32)
    step = (w.reshape(N, -1, 32).amax(-1) - w.reshape(N, -1, 32).amin(-1)) / 15
    err = (layer.dequantize() - w).abs().reshape(N, -1, 32) / step[..., None]
    assert float(err.max()) <= 0.5 + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer_cls", [Int4Linear, Int8Linear])
def test_quant_tiled_rows_do_not_depend_on_the_batch(layer_cls: type, dtype: torch.dtype) -> None:
    """Invariant 7 for quantized linears: a row's output is the same whatever rows share the call."""
    layer = layer_cls.quantize(torch.randn(N, K) * 0.02, dtype)
    x = torch.randn(45, K).to(dtype)
    full = quant_tiled(layer, x, None)
    for rows in (slice(0, 1), slice(3, 4), slice(7, 40)):
        assert torch.equal(quant_tiled(layer, x[rows], None), full[rows])


@pytest.mark.parametrize("layer_cls", [Int4Linear, Int8Linear])
def test_dispatch_small_batches_quantized_large_dense(layer_cls: type) -> None:
    w = torch.randn(N, K) * 0.02
    weight = QuantizedWeight(layer_cls.quantize(w, torch.float32), w)
    linear = make_linear(torch.nn.functional.linear, deterministic=False)
    small, large = torch.randn(layer_cls.max_rows, K), torch.randn(layer_cls.max_rows + 1, K)
    assert torch.equal(linear(small, weight), weight.quant(small))
    assert torch.equal(linear(large, weight), torch.nn.functional.linear(large, w))
    det = make_linear(torch.nn.functional.linear, deterministic=True)
    assert torch.equal(det(large, weight), quant_tiled(weight.quant, large, None))
