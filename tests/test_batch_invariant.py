"""The primitives deterministic mode relies on give bit-identical rows whatever the batch."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gpu.batch_invariant import LINEAR_TILE, linear_tiled, pointwise
from gpu.models.llama import LlamaModel


@pytest.mark.parametrize("rows", [1, 2, 7, LINEAR_TILE, LINEAR_TILE + 1, 300])
@pytest.mark.parametrize("offset", [0, 3, LINEAR_TILE - 1])
def test_tiled_linear_rows_do_not_depend_on_the_batch(rows: int, offset: int) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(400, 64)
    alone = linear_tiled(x[offset : offset + 1], w, b)
    inside = linear_tiled(x[offset : offset + rows], w, b)[:1]
    assert torch.equal(alone, inside)
    assert torch.allclose(alone, torch.nn.functional.linear(x[offset : offset + 1], w, b), atol=1e-5)


def place_invariant(linear: Callable[..., torch.Tensor], width: int) -> bool:
    """Each row computed at every place in a tile (the batch shifted by 1..44 rows) gives
    the same bits."""
    torch.manual_seed(0)
    x, w = torch.randn(45, 64), torch.randn(width, 64) / 8
    full = linear(x, w)
    return all(torch.equal(linear(x[s:], w), full[s:]) for s in range(1, 45))


@pytest.mark.parametrize("width", [1, 2, 6, 96])  # output columns: 1 is a shared expert's gate
def test_tiled_linear_rows_do_not_depend_on_their_place_in_a_tile(width: int) -> None:
    assert place_invariant(linear_tiled, width)


def test_red_a_one_column_weight_not_padded() -> None:
    """The guard above on the tiles' bmm run on a one-column weight as it is (no zero
    column): red where this CPU's matrix-vector path sums in another order at other places
    in a tile (an AMD EPYC AVX2 does); skipped where it does not."""
    def unpadded(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        pad = (-x.shape[0]) % LINEAR_TILE
        xp = torch.nn.functional.pad(x, (0, 0, 0, pad))
        tiles = xp.shape[0] // LINEAR_TILE
        out = torch.bmm(xp.view(tiles, LINEAR_TILE, x.shape[1]), weight.t().expand(tiles, -1, -1))
        return out.view(-1, weight.shape[0])[: x.shape[0]]

    assert place_invariant(unpadded, 2)  # the same computation, two columns: invariant
    if place_invariant(unpadded, 1):
        pytest.skip("this CPU's one-column GEMM is row-invariant: the planted bug changes nothing here")


def tail_invariant(op: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> bool:
    """An elementwise op gives each element the same bits wherever the tensor's vectorized
    body ends and its scalar tail begins (slices of 1..100 elements at 40 offsets)."""
    torch.manual_seed(0)
    x = (torch.randn(4000) * 4).to(dtype)
    full = op(x)
    return all(torch.equal(op(x[s : s + n]), full[s : s + n]) for s in range(40) for n in (1, 3, 7, 9, 17, 33, 100))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_is_batch_invariant(dtype: torch.dtype) -> None:
    from gpu.models.hybrid_common import sigmoid

    assert tail_invariant(sigmoid, dtype)
    assert torch.allclose(sigmoid(torch.linspace(-30, 30, 601)), torch.sigmoid(torch.linspace(-30, 30, 601)),
                          rtol=0, atol=2e-7)


def test_red_torch_sigmoid() -> None:
    """The guard above on torch.sigmoid itself (what the product's sigmoid replaces): red
    where its float32 vectorized and scalar paths round apart (an AMD EPYC AVX2: 12 of
    280 slices); skipped where they do not."""
    if tail_invariant(torch.sigmoid, torch.float32):
        pytest.skip("this CPU's torch.sigmoid rounds alike on both paths: nothing to plant")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", [F.silu, torch.sigmoid], ids=["silu", "sigmoid"])
def test_pointwise_ops_are_batch_invariant(op: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> None:
    """`pointwise` (gpu/batch_invariant.py) keeps every element off torch's scalar tail loop:
    Qwen3.5's conv output over 2 tensor-parallel ranks is 48 wide, all tail at one token."""
    assert tail_invariant(lambda x: pointwise(op, x), dtype)
    x = torch.randn(7, 48, dtype=dtype)
    assert torch.equal(pointwise(op, x), op(x.float()).to(dtype)) or torch.allclose(
        pointwise(op, x).float(), op(x.float()), rtol=1e-2, atol=1e-6)


def test_red_raw_silu() -> None:
    """The guard above on F.silu itself (what `pointwise` wraps): red where its float32
    vectorized and scalar paths round apart (the AVX-512 EPYC this was found on);
    skipped where they do not."""
    if tail_invariant(F.silu, torch.float32):
        pytest.skip("this CPU's F.silu rounds alike on both paths: nothing to plant")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The product's RMSNorm (`LlamaModel._rms_norm`), on a stand-in for the model."""
    model = SimpleNamespace(arch=SimpleNamespace(rms_norm_eps=eps))
    return LlamaModel._rms_norm(model, x, weight)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576,), (9, 64)])  # hidden rows; q/k-norm [T, heads, D]
@pytest.mark.parametrize("rows", [1, 2, 64, 1000])
@pytest.mark.parametrize("offset", [0, 17])
def test_llama_rms_norm_rows_do_not_depend_on_the_batch(
    rows: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    torch.manual_seed(1)
    x = (torch.randn(1100, *shape) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    alone = rms_norm(x[offset : offset + 1], weight)
    inside = rms_norm(x[offset : offset + rows], weight)[:1]
    assert alone.dtype == dtype and torch.equal(alone, inside)
    # ...and it is an RMSNorm over the last dimension (an invariant but wrong norm fails).
    xf = x[offset : offset + 1].float()
    ref = weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(alone.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 2, 64, 1000])
def test_log_softmax_is_batch_invariant(rows: int) -> None:
    torch.manual_seed(1)
    logits = torch.randn(1000, 4096) * 4
    assert torch.equal(torch.log_softmax(logits[:rows], -1)[:1], torch.log_softmax(logits[:1], -1))
