"""Batch-invariant building blocks for deterministic mode.

NOTE: invariant 7 lives here. A plain `F.linear` picks its kernel by the number of rows
(one row takes a matrix-vector path, more rows a blocked GEMM), so a token's outputs
change in the last bits with the batch around it. On CPU, cutting the rows into tiles of
a fixed size and running one batched GEMM of that fixed shape computes every row with
the same kernel and reduction order, whatever the batch, the chunking or the row's
position; row-wise reductions (RMSNorm's mean, log_softmax, argmax) and elementwise ops
are already batch-invariant in torch on CPU, and tests pin that down. On CUDA neither
holds (cuBLAS picks split-K and tiles by the batch count; torch's reductions split a row
among more threads when rows are few), so the GEMMs and row sums there run fixed-shape
Triton kernels (gpu/kernels/triton_invariant.py). Triton is imported only on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LINEAR_TILE = 32  # rows per fixed-shape GEMM (CPU)
# Elements: a multiple of every CPU's vectorized loop step (2 vectors of 16 float32 lanes
# on AVX-512, of 8 on AVX2).
POINTWISE_BLOCK = 64


def linear_tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose rows do not depend on how many rows there are."""
    if x.is_cuda:
        out = bmm(x[None], weight.t()[None])[0]
        return out + bias if bias is not None else out
    if weight.shape[0] == 1:
        # NOTE: with one output column the GEMM becomes a matrix-vector product whose sums
        # run in an order that depends on the row's place in its tile (seen on CPU: a
        # shared expert's gate). A zero second column keeps it a GEMM (every width >= 2
        # measured row-invariant); the column is dropped again below.
        return linear_tiled(x, F.pad(weight, (0, 0, 0, 1)), None if bias is None else F.pad(bias, (0, 1)))[:, :1]
    n = x.shape[0]
    pad = (-n) % LINEAR_TILE
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    tiles = xp.shape[0] // LINEAR_TILE
    out = torch.bmm(xp.view(tiles, LINEAR_TILE, x.shape[1]), weight.t().expand(tiles, -1, -1))
    out = out.view(-1, weight.shape[0])[:n]
    return out + bias if bias is not None else out


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise op (silu, sigmoid) such that every element of x takes
    torch's vectorized code.

    NOTE: invariant 7. On CPU an elementwise op runs its vectorized code over whole steps
    of 2 vectors and its scalar code over the rest, and for transcendental ops the two
    differ in the last bit. Which elements are the rest depends on the shape: a contiguous
    tensor is one flat loop (its tail depends on the length, i.e. on the batch), a strided
    view one loop per row (each row's tail). Seen: Qwen3.5's conv output split over 2
    tensor-parallel ranks is 48 wide, all tail at one token. So x runs as one contiguous
    flat loop whose length is a whole number of steps for each thread's share."""
    flat = x.reshape(-1)  # a copy only for a strided view
    if x.is_cuda:
        return fn(x)
    n = flat.numel()
    pad = (-n) % (POINTWISE_BLOCK * torch.get_num_threads())
    if pad:
        flat = F.pad(flat, (0, pad))
    return fn(flat)[:n].view(x.shape)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm` whose rows do not depend on the batch count or the row count: torch's
    on CPU (fixed-shape operands, as the callers pass them), a fixed-tile kernel on CUDA."""
    if a.is_cuda:
        from gpu.kernels import triton_invariant

        return triton_invariant.bmm(a, b)
    return torch.bmm(a, b)


def mean_of_squares(xf: torch.Tensor) -> torch.Tensor:
    """mean(x^2) over the last axis -> [..., 1] (RMSNorm), float32 in and out."""
    if xf.is_cuda:
        from gpu.kernels import triton_invariant

        return triton_invariant.row_sum(xf, square=True) / xf.shape[-1]
    return xf.pow(2).mean(-1, keepdim=True)


def sum_last(x: torch.Tensor, square: bool = False) -> torch.Tensor:
    """Sum (of squares) over the last axis -> [..., 1], in x's dtype."""
    if x.is_cuda:
        from gpu.kernels import triton_invariant

        return triton_invariant.row_sum(x, square=square).to(x.dtype)
    return (x * x if square else x).sum(-1, keepdim=True)
