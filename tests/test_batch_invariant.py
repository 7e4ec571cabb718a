"""The primitives deterministic mode relies on give bit-identical rows whatever the batch."""

from __future__ import annotations

import pytest
import torch

from gpu.batch_invariant import LINEAR_TILE, linear_tiled


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


@pytest.mark.parametrize("rows", [1, 2, 64, 1000])
def test_row_reductions_are_batch_invariant(rows: int) -> None:
    torch.manual_seed(1)
    x = torch.randn(1000, 576)
    assert torch.equal(x[:rows].pow(2).mean(-1)[:1], x[:1].pow(2).mean(-1))
    logits = torch.randn(1000, 4096) * 4
    assert torch.equal(torch.log_softmax(logits[:rows], -1)[:1], torch.log_softmax(logits[:1], -1))
