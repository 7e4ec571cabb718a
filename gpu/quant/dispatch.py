"""Quantized weights in the model: how they are built from a checkpoint and which kernel a
matmul runs.

`model.quantization`:
- `int4`: a linear whose checkpoint tensors are all GGUF Q4_0/Q4_1 blocks runs the 4-bit op
  on those very blocks; any other linear (e.g. SmolLM2's Q8_0 tied embedding used as the
  output head, or float weights) runs int8 per channel: never coarser than the checkpoint.
- `int8`: every linear runs int8 per output channel, requantized from the float weight.

Per call (non-deterministic mode): the quantized op only for batches of at most
`max_rows` rows (4 for int8, 8 for int4: the crossovers measured by
benchmarks/quant_linear.py), where weight bytes bound the time (decode); larger batches are
compute-bound and bfloat16/float32 GEMMs beat the quantized ops there
(benchmarks/quant_linear.py), so the layer keeps its dense weight for them too: memory is
the dense weight plus the quantized one (+25 % over bf16 for int4, +50 % for int8).
With `QuantSpec.cpu_kernels` (model.cpu_kernels on) the
quantized linears run tierserve's C++ kernels instead of torch's ops (gpu/quant/gemv.py), in
the same number of bytes, both on int8 activations: int8 up to its crossover (16 rows against
bfloat16 GEMMs on AMX, every batch where the kernel has AVX512-VNNI and the GEMMs no AMX; 64
against float32 ones), 4-bit at every batch size (it beats float32 GEMMs and bf16 ones without
AMX at prefill shapes too: `benchmarks/quant_linear.py --model --force-quant`) except against
bf16 GEMMs on AMX (24 rows); a layer that takes every batch keeps no dense copy.

NOTE: invariant 7. In deterministic mode every row runs the quantized op (never the dense
copy, which is not kept): the C++ kernels as they are (a row's result depends on its own x
and the weight only, quant_gemv_core.h), torch's ops in fixed tiles of LINEAR_TILE rows; so
a token's logits do not depend on how many rows share its step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from gpu.batch_invariant import LINEAR_TILE
from gpu.quant.gguf_blocks import Q4Blocks, cat_blocks
from gpu.quant.linears import UNLIMITED, Int4Linear, Int8Linear, QuantLinear


class QuantSpec(NamedTuple):
    mode: str  # "int8" | "int4"
    blocks: Mapping[str, Q4Blocks]  # raw Q4 blocks by Hugging Face name (int4 only)
    keep_dense: bool  # False in deterministic mode (the dense copy would never run)
    cpu_kernels: bool = False  # try tierserve's C++ CPU kernels (gpu/kernels/cpu/)


class QuantizedWeight(NamedTuple):
    quant: QuantLinear
    dense: torch.Tensor | None  # the float weight in the compute dtype, for many-row batches


LinearWeight = torch.Tensor | QuantizedWeight
Linear = Callable[..., torch.Tensor]


def build_linear(spec: QuantSpec | None, names: Sequence[str], dense: torch.Tensor) -> LinearWeight:
    """The weight of the linear fused from checkpoint tensors `names` (`dense`: their
    concatenation in the compute dtype)."""
    if spec is None:
        return dense
    quant: QuantLinear
    if spec.mode == "int4" and all(n in spec.blocks for n in names):
        nibbles, scales, zeros = cat_blocks([spec.blocks[n] for n in names])
        quant = Int4Linear(nibbles, scales, zeros, dense.dtype, kernels=spec.cpu_kernels)
    else:
        quant = Int8Linear.quantize(dense, dense.dtype, kernels=spec.cpu_kernels)
    # NOTE: no dense copy where the quantized layer takes every batch: it would never run.
    keep = spec.keep_dense and quant.max_rows < UNLIMITED
    return QuantizedWeight(quant, dense if keep else None)


def make_linear(dense_linear: Linear, deterministic: bool, float_linear: Linear | None = None) -> Linear:
    """linear(x, weight, bias): `float_linear` (default `dense_linear`: F.linear or the
    batch-invariant tiled one) on float weights, the quantized op or the dense copy (through
    `dense_linear`) on quantized ones (rule above)."""
    on_floats = float_linear or dense_linear

    def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return on_floats(x, weight, bias)
        if deterministic:
            # NOTE: invariant 7: the C++ kernels' rows are their own (any row count); torch's ops in tiles.
            return weight.quant(x, bias) if weight.quant.row_invariant else quant_tiled(weight.quant, x, bias)
        if x.shape[0] <= weight.quant.max_rows or weight.dense is None:
            return weight.quant(x, bias)
        return dense_linear(x, weight.dense, bias)

    return linear


def quant_tiled(layer: QuantLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The quantized op over fixed LINEAR_TILE-row tiles: every row sees the same kernel shape."""
    n = x.shape[0]
    pad = (-n) % LINEAR_TILE
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    out = torch.cat([layer(tile) for tile in xp.split(LINEAR_TILE)])[:n]
    return out + bias if bias is not None else out

