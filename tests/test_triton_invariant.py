"""Deterministic mode's CUDA matmuls and row sums (gpu/kernels/triton_invariant.py): values
against torch, and a row's bits independent of the batch, the row count and the row's
place. In the Triton interpreter on CPU; compiled on CUDA (benchmarks/gpu_check.py), which
is where invariance is really at stake (cuBLAS and torch's reductions are not).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from gpu.kernels import triton_invariant

DEVICE = torch.device("cuda" if CUDA else "cpu")


def skip_interpreted_bf16_dot(dtype: torch.dtype) -> None:
    """The interpreter's tl.dot reads bfloat16 operands as integers (values ~1e10; seen with
    triton 3.9): bf16 GEMMs are checked compiled only."""
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("the Triton interpreter's bf16 tl.dot is wrong; checked on CUDA")


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "m", "k", "n"), [(1, 1, 40, 65), (3, 37, 64, 64), (2, 70, 96, 130)])
def test_bmm_matches_torch(dtype: torch.dtype, batch: int, m: int, k: int, n: int) -> None:
    skip_interpreted_bf16_dot(dtype)
    a, b = rand(batch, m, k, seed=1, dtype=dtype), rand(batch, k, n, seed=2, dtype=dtype)
    got = triton_invariant.bmm(a, b)
    want = torch.bmm(a.float(), b.float())
    assert got.dtype == dtype and got.shape == (batch, m, n)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol * k**0.5, rtol=tol)


def test_bmm_reads_strided_operands() -> None:
    """A linear's weight is passed transposed and expanded over the batch (stride 0)."""
    x, w = rand(2, 9, 48, seed=3), rand(33, 48, seed=4)
    got = triton_invariant.bmm(x, w.t().expand(2, -1, -1))
    torch.testing.assert_close(got, x @ w.t(), atol=1e-4, rtol=1e-4)


def test_bmm_rejects_mismatched_operands() -> None:
    with pytest.raises(ValueError, match="shapes"):
        triton_invariant.bmm(rand(1, 4, 8, seed=0), rand(1, 9, 4, seed=0))
    with pytest.raises(ValueError, match="dtypes"):
        triton_invariant.bmm(rand(1, 4, 8, seed=0), rand(1, 8, 4, seed=0, dtype=torch.bfloat16))


def rows_invariant(matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype) -> bool:
    """Row 0's bits alone, inside 5, 40 and 100 rows, at offsets 0 and 3, and in a batch of 4."""
    x, w = rand(110, 96, seed=5, dtype=dtype), rand(96, 80, seed=6, dtype=dtype)
    alone = matmul(x[3:4][None], w[None])[0]
    for rows in (5, 40, 100):
        for offset in (0, 3):
            if offset:
                got = matmul(x[:rows][None], w[None])[0][3:4]
            else:
                got = matmul(x[3 : 3 + rows][None], w[None])[0][:1]
            if not torch.equal(got, alone):
                return False
    batched = matmul(x[:40].reshape(4, 10, 96), w.expand(4, -1, -1))
    return torch.equal(batched[0, 3:4], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_rows_are_batch_invariant(dtype: torch.dtype) -> None:
    skip_interpreted_bf16_dot(dtype)
    assert rows_invariant(triton_invariant.bmm, dtype)


def test_red_a_split_k_chosen_by_the_row_count() -> None:
    """Planted: K split in two partial products summed afterwards when there are many rows
    (what cuBLAS's split-K does for some shapes). The K sums then run in another order for
    those rows, and the invariance check goes red. (Another BLOCK_K alone would not: on
    CUDA a float32 tile accumulates K in order by FMA whatever the block.)"""

    def split_by_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.shape[1] <= 32:
            return triton_invariant.bmm(a, b)
        half = a.shape[2] // 2
        return triton_invariant.bmm(a[..., :half], b[:, :half]) + triton_invariant.bmm(a[..., half:], b[:, half:])

    assert not rows_invariant(split_by_rows, torch.float32)


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("n", [1, 96, 1500, 2048])
def test_row_sum_matches_torch(square: bool, n: int) -> None:
    x = rand(7, n, seed=n)
    want = (x * x if square else x).sum(-1, keepdim=True)
    torch.testing.assert_close(triton_invariant.row_sum(x, square), want, atol=1e-4 * n**0.5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_sum_is_batch_invariant(dtype: torch.dtype) -> None:
    x = rand(300, 1500, seed=7, dtype=dtype)
    alone = triton_invariant.row_sum(x[5:6], square=True)
    assert torch.equal(triton_invariant.row_sum(x, square=True)[5:6], alone)
    assert torch.equal(triton_invariant.row_sum(x[5:9].view(2, 2, 1500), square=True)[0, :1], alone)
    assert torch.equal(triton_invariant.row_sum(x[:, :700].t().t(), square=True)[5:6],
                       triton_invariant.row_sum(x[5:6, :700].contiguous(), square=True))
