"""Batch-invariant Triton kernels: deterministic mode's matmuls and row sums on CUDA.

NOTE: invariant 7 on CUDA. cuBLAS picks its GEMM (tile shape, split-K) from the whole
problem's shape, batch count included, and torch's CUDA reductions share a row among
more threads when there are fewer rows; either way a token's bits change with the batch
around it (seen on an H200: a decode hit's logprobs 1e-7 off the cold run's). Here
everything that shapes the arithmetic is a constant of the kernel: tile sizes, warps, a
K loop in order with no split, one program per output tile or per row. The number of
rows (`M`, not specialized on) only changes how many programs run, and a row's result
never reads another row, so it is the same whichever batch, chunk or tile row it is in.

Tested for values and invariance under TRITON_INTERPRET=1 on CPU and compiled on CUDA
(tests/test_triton_invariant.py; benchmarks/gpu_check.py runs it there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32
BLOCK_N = 64
BLOCK_K = 32
ROW_BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["M"])
def _bmm_kernel(
    a, b, c, M, N, K,
    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptr = a + batch * s_ab + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak
    b_ptr = b + batch * s_bb + rk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        in_k = (k0 + rk) < K
        x = tl.load(a_ptr, mask=(rm[:, None] < M) & in_k[None, :], other=0.0)
        y = tl.load(b_ptr, mask=in_k[:, None] & (rn[None, :] < N), other=0.0)
        if IEEE:  # float32 in: no TF32, as the torch paths run it
            acc = tl.dot(x, y, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, y, acc)
        a_ptr += BK * s_ak
        b_ptr += BK * s_bk
    c_ptr = c + batch * s_cb + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
    tl.store(c_ptr, acc.to(c.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["rows"])
def _row_sum_kernel(x, out, rows, n, stride, SQUARE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        v = tl.load(x + row * stride + start + offs, mask=(start + offs) < n, other=0.0).to(tl.float32)
        if SQUARE:
            v = v * v
        acc += v
    tl.store(out + row, tl.sum(acc, axis=0))


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm` (a [B, M, K] @ b [B, K, N] -> [B, M, N], a's dtype, float32
    accumulation) whose rows do not depend on B or M. Any strides: an expanded b (batch
    stride 0) is read in place."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"bmm shapes {tuple(a.shape)} x {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"bmm dtypes {a.dtype} x {b.dtype}")
    batch, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), batch)
    _bmm_kernel[grid](
        a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride(),
        IEEE=a.dtype == torch.float32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS,
    )  # fmt: skip
    return c


def row_sum(x: torch.Tensor, square: bool = False) -> torch.Tensor:
    """Sum (of squares, with `square`) over the last axis in float32 -> [..., 1], each row
    by one program in the same order whatever the number of rows."""
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty((flat.shape[0],), dtype=torch.float32, device=x.device)
    if flat.shape[0]:
        block = min(ROW_BLOCK, triton.next_power_of_2(n))
        _row_sum_kernel[(flat.shape[0],)](
            flat, out, flat.shape[0], n, flat.stride(0), SQUARE=square, BLOCK=block, num_warps=NUM_WARPS
        )
    return out.view(*x.shape[:-1], 1)
