"""Structured outputs on the device side: the allowed-token bitmask of constrained rows.

A constrained sampling row carries a `TokenMasker` (kernel/grammar.py's per-request
matcher). When a batch has one, the device thread fills an int32 bitmask [R, ceil(V/32)]
for those R rows (bit t of a row: token t allowed) and the sampler sets every other
token's logit to -inf before penalties, sampling and logprobs, so the reported logprobs
are of the constrained distribution (like the logit_bias ones). Unconstrained rows and
batches pay nothing. The fill runs on the device thread after the forward is queued, so
on CUDA it overlaps the forward; the bitmask is built on the host (the matcher writes
host memory) and copied once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class TokenMasker(Protocol):
    """Writes the tokens a row may sample next into its row of an int32 bitmask."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None: ...


@dataclass(frozen=True)
class TokenMask:
    rows: torch.Tensor  # [R] int64 indices of the constrained rows in the batch
    bitmask: torch.Tensor  # [R, ceil(V/32)] int32, on the logits' device


def mask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def build_token_mask(maskers: Sequence[TokenMasker | None], vocab_size: int,
                     device: torch.device) -> TokenMask | None:
    """The bitmask of the rows that have a masker; None when no row has one."""
    rows = [i for i, m in enumerate(maskers) if m is not None]
    if not rows:
        return None
    # Zeros (nothing allowed) past what a masker writes: ids beyond its vocabulary stay out.
    bitmask = torch.zeros(len(rows), mask_width(vocab_size), dtype=torch.int32)
    for r, i in enumerate(rows):
        masker = maskers[i]
        assert masker is not None
        masker.fill_mask(bitmask, r)
    return TokenMask(torch.tensor(rows, dtype=torch.int64, device=device), bitmask.to(device))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] bool from an int32 [R, W] bitmask (bit b of word w is token 32 w + b)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 comes out right too
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_mask(logits: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    """logits with every disallowed token of a constrained row at -inf (a new tensor when
    there is a mask: the input stays as it is)."""
    if mask is None:
        return logits
    allowed = allowed_tokens(mask.bitmask, logits.shape[1])
    rows = logits.index_select(0, mask.rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, mask.rows, rows)
